"""`python -m services.gate --config gate.toml --set gate.admission_wait_s=10`"""

import sys

from services.gate.config import GateConfig
from services.gate.main import serve
from shared.service import run_service

if __name__ == "__main__":
    sys.exit(run_service("gate", GateConfig, serve))

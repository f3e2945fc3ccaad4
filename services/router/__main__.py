"""`python -m services.router --config router.toml --set router.port=8000`"""

import sys

from services.router.config import RouterConfig
from services.router.main import serve
from shared.service import run_service

if __name__ == "__main__":
    sys.exit(run_service("router", RouterConfig, serve))

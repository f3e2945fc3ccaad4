"""`python -m services.master --set master.rpc_port=50051 --set master.client_ttl_s=10`"""

import sys

from services.master.config import MasterConfig
from services.master.main import serve
from shared.service import run_service

if __name__ == "__main__":
    sys.exit(run_service("master", MasterConfig, serve))

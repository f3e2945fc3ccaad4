"""`python -m services.store --set store.segment_bytes=4294967296 --set store.master_addr=10.0.0.5:50051`"""

import sys

from services.store.config import StoreConfig
from services.store.main import serve
from shared.service import run_service

if __name__ == "__main__":
    sys.exit(run_service("store", StoreConfig, serve))

import sys

from services.decode.config import DecodeConfig
from services.decode.main import serve
from shared.service import run_service

sys.exit(run_service("decode", DecodeConfig, serve))

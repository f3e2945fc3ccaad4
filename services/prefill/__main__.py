import sys

from services.prefill.config import PrefillConfig
from services.prefill.main import serve
from shared.service import run_service

sys.exit(run_service("prefill", PrefillConfig, serve))

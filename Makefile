# The two set-up commands in the README: `make up` (main job) and `make test` (whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: env up test test-fast test-gpu gpu-kit bench
env:
	@bash infra/dev-env.sh

up: env
	$(VENV)/bin/moorage up

test: env
	$(PY) -m pytest

test-fast: env
	$(PY) -m pytest -m "not slow"

# The device check (tests/gpu, marker gpu; never part of `make test`): on a CUDA host,
# MOORAGE_FLAVOR=cuda make test-gpu. One GPU-CHECK line per check at the end.
test-gpu: env
	MOORAGE_GPU_TESTS=1 $(PY) -m pytest tests/gpu -p no:cacheprovider
	MOORAGE_GPU_TESTS=1 $(PY) -m bench.attention_device --out bench/results/attention-device.json

# What the check needs on a lent device machine that reaches no network (.devcarry/, carried by the device tool;
# there: python3 -m infra.device_kit run). See infra/device_kit.py.
gpu-kit: env
	$(PY) -m infra.device_kit build

bench: env
	$(PY) -m bench.engine --out bench/results/engine.json
	$(PY) -m bench.handoff --out bench/results/handoff.json

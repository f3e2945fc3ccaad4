# The two set-up commands in the README: `make up` (main job) and `make test` (whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: env up test test-fast bench
env:
	@bash infra/dev-env.sh

up: env
	$(VENV)/bin/moorage up

test: env
	$(PY) -m pytest

test-fast: env
	$(PY) -m pytest -m "not slow"

bench: env
	$(PY) -m bench.engine --out bench/results/engine.json
	$(PY) -m bench.handoff --out bench/results/handoff.json

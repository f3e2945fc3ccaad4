#!/usr/bin/env bash
# moorage bench aiperf from the repository root: AIPerf (in its own .venv-aiperf, made on first use) replays
# a synthetic agent corpus against moorage up with SmolLM2, pool on and off. Results: runs/aiperf-<time>/.
#   bash bench/aiperf.sh --quick                         # concurrency 1,2 on a tiny corpus (a few minutes)
#   bash bench/aiperf.sh --out bench/results/aiperf.json # the full benchmark, into the committed results
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash infra/dev-env.sh
exec .venv/bin/python -m bench.aiperf "$@"

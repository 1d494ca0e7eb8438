#!/usr/bin/env bash
# Set up a virtual environment in .venv and run the built-in demo on a local Ray (CPU, about 9 minutes with the
# installs on 2 idle cores). Extra arguments go to `ray-cluster-ft demo`, e.g. `bash scripts/demo.sh --output runs/my-demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q -e .
pip install -q --no-deps -r requirements-demo.txt
ray-cluster-ft demo "$@"

#!/usr/bin/env bash
# Makes .venv with everything the demo, the benchmarks and the tests need, from nothing but Python.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "setup: $*" >&2; }
say "making .venv"
python3 -m venv .venv
pip=".venv/bin/pip"
# torch first and pinned: the CPU wheel on these machines (a looser pin would pull a CUDA build)
say "installing torch 2.13.0 (the CPU wheel: about a minute)"
$pip install -q "torch==2.13.0"
say "installing embfuse with triton, rich, matplotlib, pytest, hypothesis"
$pip install -q -e ".[triton,cli,test]"
# MovieLens-100K for `embfuse demo` ships inside recbole's wheel; none of its own needs are used
say "installing MovieLens-100K (inside the recbole wheel)"
$pip install -q --no-deps "recbole==1.2.1"
say "done"

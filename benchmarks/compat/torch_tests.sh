#!/usr/bin/env bash
# PyTorch's own test/nn/test_embedding.py with embfuse's functions and modules in torch's place,
# run from outside this repository, stock and swapped.
#   bash benchmarks/compat/torch_tests.sh TEST_EMBEDDING_PY [VENV]
# TEST_EMBEDDING_PY: test/nn/test_embedding.py from a PyTorch checkout (not part of this project).
# VENV (default /tmp/torch-tests-venv) gets torch 2.13 CPU, pytest, expecttest, hypothesis and
# embfuse (editable). Prints the stock and swapped counts; the swapped log lists the failures.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
file=$(cd "$(dirname "${1:?test_embedding.py from a PyTorch checkout}")" && pwd)/$(basename "$1")
venv=${2:-/tmp/torch-tests-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0 pytest expecttest hypothesis numpy
  "$venv/bin/pip" install -q --no-deps -e "$repo"
fi
work=$(mktemp -d)
cp "$file" "$here/torch_swap.py" "$work/"
cd "$work"  # outside the repository
for swap in 0 1; do
  printf '%-8s ' "$([ $swap = 1 ] && echo embfuse || echo stock)"
  SWAP=$swap PYTHONPATH="$work" "$venv/bin/python" -m pytest -p torch_swap -q -p no:cacheprovider --tb=line -rf \
    test_embedding.py > "$work/swap-$swap.log" 2>&1 || true
  tail -1 "$work/swap-$swap.log"
done
echo "failures with embfuse swapped in: $work/swap-1.log"

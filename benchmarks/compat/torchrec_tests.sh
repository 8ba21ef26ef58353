#!/usr/bin/env bash
# TorchRec's own tests with embfuse's classes in TorchRec's place, run from outside this repository.
#   bash benchmarks/compat/torchrec_tests.sh TORCHREC_GIT [VENV]
# TORCHREC_GIT: a clone of github.com/pytorch/torchrec (its .git directory or work tree); the tests
# are taken from commit $TORCHREC_COMMIT (default a48cef79, the one NOTES.md's counts come from).
# VENV (default /tmp/torchrec-venv) gets torch 2.13 CPU, torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0 and
# embfuse (editable). Prints the stock and swapped counts of the sparse and embedding-module tests.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
src=${1:?a torchrec clone}
venv=${2:-/tmp/torchrec-venv}
commit=${TORCHREC_COMMIT:-a48cef79}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q torchrec==1.8.0 pytest hypothesis parameterized
  # torchrec pulls the CUDA fbgemm_gpu; both wheels install the same package, so swap it whole
  "$venv/bin/pip" uninstall -y -q fbgemm_gpu fbgemm_gpu-cpu || true
  "$venv/bin/pip" install -q --no-deps fbgemm-gpu-cpu==1.8.0
  "$venv/bin/pip" install -q --no-deps -e "$repo"
fi
site=$("$venv/bin/python" -c "import torchrec, os; print(os.path.dirname(torchrec.__file__))")
work=$(mktemp -d)
git -C "$src" archive "$commit" torchrec/sparse/tests torchrec/modules/tests | tar x -C "$work"
for d in sparse/tests modules/tests; do mkdir -p "$site/$d" && cp -r "$work/torchrec/$d/." "$site/$d/"; done
cp "$here/torchrec_swap.py" "$work/"
cd "$work"  # outside the repository
sparse="$site/sparse/tests/test_jagged_tensor.py $site/sparse/tests/test_keyed_jagged_tensor.py $site/sparse/tests/test_keyed_tensor.py"
modules="$site/modules/tests/test_embedding_modules.py"
for swap in 0 1; do
  for set in sparse modules; do
    printf '%-8s %-8s ' "$([ $swap = 1 ] && echo embfuse || echo stock)" "$set"
    SWAP=$swap PYTHONPATH="$work" "$venv/bin/python" -m pytest -p torchrec_swap -q -p no:cacheprovider \
      --tb=line -rf ${!set} > "$work/$set-$swap.log" 2>&1 || true
    tail -1 "$work/$set-$swap.log"
  done
done
echo "failures with embfuse swapped in, and their first error lines: $work/{sparse,modules}-1.log"

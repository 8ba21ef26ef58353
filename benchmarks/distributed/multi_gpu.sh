#!/usr/bin/env bash
# Issue 26's runs on one host of N GPUs, in one command (about 8 minutes at N = 2 on H200s):
#   bash benchmarks/distributed/multi_gpu.sh N OUT [PART]
# PART: "check" (every plan against the unsharded collection, a bad batch on one rank, a
# checkpoint from every rank, TrainPipeline against the plain loop; then the step's phases),
# "bench" (`embfuse bench --distributed` and the synthetic demo, on 1 GPU and on N; on N also
# with the pooled rows sent in bf16, and with the overlap pass under torch.compile, its all-to-all
# eager or functional), or both when left out. Writes OUT/log.txt, OUT/bench-1, OUT/bench-N,
# OUT/bench-N-bf16, OUT/bench-N-compiled, OUT/demo-1, OUT/demo-N.
# Run from the repository root with torch and Triton installed; EMBFUSE_COMMIT tags the results
# of a copy without its git history.
set -uo pipefail
N=${1:?number of GPUs}
OUT=${2:?output folder}
PART=${3:-all}
mkdir -p "$OUT"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
WORLDS=$(printf '1\n%s\n' "$N" | sort -un)
quiet() { grep -v -e "Warn" -e "warn" -e "^W[0-9]" -e '\*\*\*\*' -e "table_wise  " ; }
run() {  # title, seconds, command...
    echo "== $1" | tee -a "$LOG"
    shift
    local limit=$1
    shift
    timeout "$limit" "$@" 2>&1 | quiet | tee -a "$LOG" | tail -14
}
if [ "$PART" != bench ]; then
    run "torchrun_compare, $N ranks" 300 torchrun --nproc_per_node="$N" --master_port 29601 \
        -m tests.distributed.torchrun_compare
    for w in $WORLDS; do
        run "phases, $w rank(s)" 120 torchrun --nproc_per_node="$w" --master_port 29602 \
            benchmarks/distributed/phases.py
    done
fi
if [ "$PART" != check ]; then
    for w in $WORLDS; do
        run "embfuse bench --distributed, $w rank(s)" 200 torchrun --nproc_per_node="$w" --master_port 29603 \
            -m embfuse.cli bench --distributed --out "$OUT/bench-$w"
    done
    if [ "$N" -gt 1 ]; then
        run "embfuse bench --distributed --comm-dtype bf16, $N ranks" 200 torchrun --nproc_per_node="$N" \
            --master_port 29603 -m embfuse.cli bench --distributed --comm-dtype bf16 --out "$OUT/bench-$N-bf16"
        run "embfuse bench --distributed --compiled, $N ranks" 400 torchrun --nproc_per_node="$N" \
            --master_port 29603 -m embfuse.cli bench --distributed --compiled --out "$OUT/bench-$N-compiled"
    fi
    for w in $WORLDS; do
        run "embfuse demo --data synthetic, $w rank(s)" 150 torchrun --nproc_per_node="$w" --master_port 29604 \
            -m embfuse.cli demo --data synthetic --samples 400000 --rows 200000 --epochs 2 --batch-size 4096 \
            --out "$OUT/demo-$w"
    done
fi

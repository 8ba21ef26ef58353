#!/usr/bin/env bash
# Issue 26's runs on one host of N GPUs (about 10 minutes at N = 2):
#   bash benchmarks/distributed/multi_gpu.sh N OUT [PARTS]
# PARTS, any of (comma-separated; check, bench and demo when left out):
#   check: every plan against the unsharded collection, a bad batch on one rank, a checkpoint
#          from every rank, TrainPipeline against the plain loop; then the step's phases;
#   bench: `embfuse bench --distributed` on 1 GPU and on N; on N with a profile of the plain and
#          overlapped loops (OUT/bench-N/profile), with the pooled rows sent in bf16, and with the
#          overlap pass under torch.compile, its all-to-all eager or functional;
#   demo:  `embfuse demo` (MovieLens, when its data is installed) and the synthetic demo, on 1 GPU
#          and on N;
#   peers (not in the default): torchrec_dmp.py (TorchRec's DMP over FBGEMM on the bench's
#          workload) on N GPUs and on 1, when torchrec and fbgemm_gpu are installed (their wheels
#          and the trimmed FBGEMM on PYTHONPATH: NOTES, session 32), and a2a_bandwidth.py on N
#          (with NCCL's defaults, then with 32 peer-to-peer channels a peer).
# Writes OUT/log.txt, OUT/bench-1, OUT/bench-N, OUT/bench-N-bf16, OUT/bench-N-compiled,
# OUT/demo-movielens-{1,N}, OUT/demo-synthetic-{1,N}.
# Run from the repository root with torch and Triton installed; EMBFUSE_COMMIT tags the results
# of a copy without its git history.
set -uo pipefail
N=${1:?number of GPUs}
OUT=${2:?output folder}
PARTS=${3:-check,bench,demo}
mkdir -p "$OUT"
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
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
has() { [[ ",$PARTS," == *",$1,"* ]]; }
if has check; then
    run "torchrun_compare, $N ranks" 300 torchrun --nproc_per_node="$N" --master_port 29601 \
        -m tests.distributed.torchrun_compare
    for w in $WORLDS; do
        run "phases, $w rank(s)" 120 torchrun --nproc_per_node="$w" --master_port 29602 \
            benchmarks/distributed/phases.py
    done
fi
if has bench; then
    for w in $WORLDS; do
        profile=$([ "$w" -gt 1 ] && echo --profile)
        run "embfuse bench --distributed $profile, $w rank(s)" 200 torchrun --nproc_per_node="$w" --master_port 29603 \
            -m embfuse.cli bench --distributed $profile --out "$OUT/bench-$w"
    done
    if [ "$N" -gt 1 ]; then
        run "embfuse bench --distributed --comm-dtype bf16, $N ranks" 200 torchrun --nproc_per_node="$N" \
            --master_port 29603 -m embfuse.cli bench --distributed --comm-dtype bf16 --out "$OUT/bench-$N-bf16"
        run "embfuse bench --distributed --compiled, $N ranks" 400 torchrun --nproc_per_node="$N" \
            --master_port 29603 -m embfuse.cli bench --distributed --compiled --out "$OUT/bench-$N-compiled"
    fi
fi
if has demo; then
    for w in $WORLDS; do
        if python3 -c "from embfuse.demo.data import movielens_dir; movielens_dir()" 2>/dev/null; then
            run "embfuse demo (MovieLens), $w rank(s)" 150 torchrun --nproc_per_node="$w" --master_port 29604 \
                -m embfuse.cli demo --out "$OUT/demo-movielens-$w"
        else
            echo "== embfuse demo (MovieLens): its data is not installed here" | tee -a "$LOG"
        fi
        run "embfuse demo --data synthetic, $w rank(s)" 150 torchrun --nproc_per_node="$w" --master_port 29604 \
            -m embfuse.cli demo --data synthetic --samples 400000 --rows 200000 --epochs 2 --batch-size 4096 \
            --out "$OUT/demo-synthetic-$w"
    done
fi
if has peers; then
    # (found, not imported: `import torchrec` needs torchrec_dmp.py's care with a trimmed FBGEMM)
    if python3 -c "import importlib.util as u; assert u.find_spec('torchrec') and u.find_spec('fbgemm_gpu')" \
        2>/dev/null; then
        for w in $(printf '%s\n1\n' "$N" | uniq); do
            # (FBGEMM's import warnings and TorchRec's plan go to the log unfiltered: the result line is shown)
            echo "== TorchRec DMP, $w rank(s)" | tee -a "$LOG"
            timeout 200 torchrun --nproc_per_node="$w" --master_port 29605 benchmarks/distributed/torchrec_dmp.py \
                >> "$LOG" 2>&1
            grep -e "^TorchRec .* DMP, world $w" "$LOG" | tail -1
        done
    else
        echo "== TorchRec DMP: torchrec or fbgemm_gpu is not installed here" | tee -a "$LOG"
    fi
    run "NCCL all-to-all alone, $N ranks" 100 torchrun --nproc_per_node="$N" --master_port 29606 \
        benchmarks/distributed/a2a_bandwidth.py
    # (NCCL's peer-to-peer channels: a setting of the user's environment, NOTES session 36)
    run "NCCL all-to-all alone, 32 channels a peer, $N ranks" 100 env NCCL_MIN_P2P_NCHANNELS=32 \
        NCCL_MAX_P2P_NCHANNELS=32 torchrun --nproc_per_node="$N" --master_port 29606 \
        benchmarks/distributed/a2a_bandwidth.py
fi

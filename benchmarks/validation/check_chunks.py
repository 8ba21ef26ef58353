"""The keyed check's blocks a program (tuning.check_chunks), swept: the Criteo-like collection
forward (26 tables x 128, bags of 1-99, power-law ids) with the rule forced to 1, 2, 4 and 8
blocks of CHECK_BLOCK values a program. Each cell: the check kernel's GPU time and the call's
(profiler, L2 cleared by other traffic before each call), the median of three alternating rounds;
"rule" is what tuning.check_chunks takes at that size. benchmarks/NOTES.md, session 47.

    PYTHONPATH=src python3 benchmarks/validation/check_chunks.py [batch ...]
"""

import statistics
import sys
from pathlib import Path

import torch

import embfuse
from embfuse.ops import tuning

sys.path.insert(0, str(Path(__file__).resolve().parent))
from narrow_ids import criteo, kernel_times  # noqa: E402

CHUNKS = (1, 2, 4, 8)


def main(batches):
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU time a call, us")
    rule = tuning.check_chunks
    try:
        for B in batches:
            kjt, _, off, ebc = criteo(B)
            n = kjt.values().numel()
            times = {c: [] for c in CHUNKS}
            with torch.no_grad():
                for _ in range(3):
                    for c in CHUNKS:
                        tuning.check_chunks = lambda n, c=c: c
                        t = kernel_times(lambda: ebc(kjt).values())
                        times[c].append((t.get("_check_bags_kernel", float("nan")), sum(t.values())))
            cells = [f"chunks {c} ({-(-n // (c * tuning.CHECK_BLOCK))} programs): check "
                     f"{statistics.median(x[0] for x in v):.1f} total {statistics.median(x[1] for x in v):.1f}"
                     for c, v in times.items()]
            print(f"B{B} ids {n / 1e6:.2f}M rule {rule(n)}: " + " | ".join(cells), flush=True)
            del off, ebc
    finally:
        tuning.check_chunks = rule
    embfuse.check_errors()


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [1024, 2048, 4096, 8192, 16384])

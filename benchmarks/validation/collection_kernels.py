"""The Criteo-like collection forward (26 tables x 128, bags of 1-99, power-law ids) kernel by
kernel: the default (check, then the pooling that reads its verdict), `off`, and `off` on int32
ids. Each line: the GPU time of each kernel a call (profiler, 20 calls, L2 cleared by other
traffic before each), three rounds; then each kernel variant's registers from Triton's cache.
Sessions 45-46 of benchmarks/NOTES.md (the status guard, the check's feature count).

    PYTHONPATH=src python3 benchmarks/validation/collection_kernels.py [batch ...]
"""

import sys
from pathlib import Path

import torch

import embfuse
from embfuse.ops import check_kernels, collection

sys.path.insert(0, str(Path(__file__).resolve().parent))
from narrow_ids import criteo, kernel_times  # noqa: E402


def main(batches):
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU time a call, us")
    for B in batches:
        kjt, kjt32, off, ebc = criteo(B)
        calls = {"default": lambda: ebc(kjt).values(), "off": lambda: off(kjt).values(),
                 "off, int32 ids": lambda: off(kjt32).values()}
        with torch.no_grad():
            for rnd in range(3):
                for name, call in calls.items():
                    t = kernel_times(call)
                    print(f"B{B} round {rnd} {name}: total {sum(t.values()):.1f} | "
                          + " | ".join(f"{k}: {v:.1f}" for k, v in sorted(t.items(), key=lambda x: -x[1])), flush=True)
        del off, ebc
    embfuse.check_errors()
    for kernel in (collection._collection_fwd_kernel, check_kernels._check_bags_kernel):
        for caches in getattr(kernel, "device_caches", {}).values():
            for key, compiled in caches[0].items():
                print(kernel.fn.__name__, "registers", compiled.n_regs, "spills", compiled.n_spills, str(key)[-120:])


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [2048, 16384])

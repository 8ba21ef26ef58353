"""Hot rows copied into each SM's shared memory: a probe of issue 25's last lever, in CUDA.

Session 47 (benchmarks/NOTES.md) found the power-law lookup bound by the L2's throughput, with
L1 serving about what the hottest 128 rows give, and estimated that a copy of the hottest rows
in each SM's shared memory (445 rows at D128, 1780 at D32, in 228 KB) would cut the L2's
traffic by about 15% (D128) and 28% (D32). Triton 3.6 cannot express it: its language has no
shared memory to index, and its Gluon dialect loads shared memory only whole (a row gather from
shared memory, `shared_memory_descriptor.gather`, is in Gluon from a later Triton). So this
probe is CUDA C++, compiled on the device by NVRTC through CuPy.

One table of 10M rows, ids numbered by frequency (power-law 1.05, "ranked": hot ids are the
small ids, so row r is hot when r < H), B65536 x L64, D128 and D32, sum pooling. Kernels: one
warp a bag, 16-byte loads (a row is D/4 lanes; at D32 four rows a step), the L64 loop unrolled
UNROLL steps, fp32 sums:
  plain        256 threads a block, a block per 8 bags (as many warps as the SM holds);
  persistent   BPS blocks of THREADS a multiprocessor, each warp pooling bags in turn;
  smem H       persistent, each block first copies rows 0..H-1 into its shared memory, then
               reads a row r < H from there and the others from global memory;
  copied, never read   as smem H, reading every row from global memory: the copy's cost alone;
each without and with the persisting window over the hottest rows (`choose`'s size), each from
an L2 with no persisting line. The library's own lookup (`off`) on the same ids beside it, and
every kernel checked against it. Kernel times (do_bench, L2 flushed), us.

Run on a GPU from the repository root: PYTHONPATH=src python benchmarks/residency/smem_hot_rows.py
"""

import cupy
import numpy as np
import torch
from l1_hot_rows import ranked_batch, report, window_lines  # (this folder: the script's own)

from embfuse.ops import l2
from embfuse.ops.embedding_bag import embedding_bag_forward

SOURCE = r"""
#define PRAGMA_TEXT(x) #x
#define UNROLL_BY(n) _Pragma(PRAGMA_TEXT(unroll n))
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
pool(const float* __restrict__ table, const long long* __restrict__ ids, float* __restrict__ out, int B, int H,
     int persistent)
{
    constexpr int LPR = D / 4;      // lanes a row (one float4 each)
    constexpr int RPW = 32 / LPR;   // rows a warp step
    constexpr int WARPS = THREADS / 32;
    extern __shared__ float4 hot[];
    const float4* t4 = reinterpret_cast<const float4*>(table);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane / LPR, col = lane % LPR;
#if USE_SMEM
    for (int i = threadIdx.x; i < H * LPR; i += THREADS) hot[i] = t4[i];
    __syncthreads();
#endif
    const long long stride = persistent ? (long long)gridDim.x * WARPS : (long long)B;
    for (long long bag = (long long)blockIdx.x * WARPS + warp; bag < B; bag += stride) {
        const long long* bid = ids + bag * L;
        const long long id0 = bid[lane], id1 = bid[lane + 32];  // L = 64: two ids a lane
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
UNROLL_BY(UNROLL)
        for (int s = 0; s < L / RPW; ++s) {
            const int r = s * RPW + sub;
            const long long row = __shfl_sync(0xffffffffu, s * RPW < 32 ? id0 : id1, r & 31);
            float4 v;
#if USE_SMEM == 1
            if (row < H) v = hot[row * LPR + col];
            else v = __ldg(t4 + row * LPR + col);
#else  // (USE_SMEM 2: the copy is made, then never read)
            v = __ldg(t4 + row * LPR + col);
#endif
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
        for (int o = LPR; o < 32; o <<= 1) {
            acc.x += __shfl_xor_sync(0xffffffffu, acc.x, o);
            acc.y += __shfl_xor_sync(0xffffffffu, acc.y, o);
            acc.z += __shfl_xor_sync(0xffffffffu, acc.z, o);
            acc.w += __shfl_xor_sync(0xffffffffu, acc.w, o);
        }
        if (sub == 0) reinterpret_cast<float4*>(out)[bag * LPR + col] = acc;
    }
}
"""
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0
SMEM = 227 * 1024  # the most one block may ask for on an H100 / H200


def kernel(D, L, threads, use_smem: int, unroll, blocks_per_sm):
    return cupy.RawKernel(SOURCE, "pool", options=(
        f"-DD={D}", f"-DL={L}", f"-DTHREADS={threads}", f"-DUSE_SMEM={use_smem}", f"-DUNROLL={unroll}",
        f"-DMINB={blocks_per_sm}", "-std=c++17"))


def measure(D, dev="cuda", rows=10_000_000, B=65536, L=64):
    ids, counted, offsets, weight, hs = ranked_batch(D, dev, rows, B, L)
    out = torch.empty(B, D, device=dev)
    window = hs.nbytes
    lines = [f"D{D} B{B} L{L}: window {window / 2**20:.1f} MB, hit {hs.hit_rate:.2f}"]
    cw, cids, cout = cupy.asarray(weight), cupy.asarray(ids), cupy.asarray(out)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    ref = embedding_bag_forward(weight, ids, offsets, None, 0, -1)[0]
    row_bytes = D * 4

    def variant(threads, use_smem, unroll, blocks_per_sm, H, persistent=True):
        k = kernel(D, L, threads, use_smem, unroll, blocks_per_sm)
        smem = H * row_bytes if use_smem else 0
        if smem > 48 * 1024:
            k.max_dynamic_shared_size_bytes = smem
        grid = SMS * blocks_per_sm if persistent else B // (threads // 32)
        args = (cw, cids, cout, np.int32(B), np.int32(H if use_smem else 0), np.int32(int(persistent)))

        def run():
            with stream:
                k((grid,), (threads,), args, shared_mem=smem)
            return out
        return run

    cases = [("library (off)", lambda: embedding_bag_forward(weight, ids, offsets, None, 0, -1)[0])]
    for unroll in (8, 16):
        cases.append((f"plain 256 threads, unroll {unroll}", variant(256, 0, unroll, 8, 0, persistent=False)))
    for threads, bps in ((1024, 1), (1024, 2), (512, 4)):
        cases.append((f"persistent {bps}x{threads}, unroll 8", variant(threads, 0, 8, bps, 0)))
    for threads, bps in ((1024, 1), (1024, 2), (512, 4)):
        h_most = (SMEM // bps - 1024) // row_bytes  # (blocks of one SM share its 228 KB)
        for H in sorted({h_most, h_most // 2, h_most // 4}):
            share = (counted < H).float().mean().item()
            cases.append((f"smem {bps}x{threads}, H {H} ({share:.1%} of lookups)", variant(threads, 1, 8, bps, H)))
        cases.append((f"  the same, H {h_most} copied, never read", variant(threads, 2, 8, bps, h_most)))
    for name, fn in cases:
        torch.testing.assert_close(fn(), ref, rtol=1e-4, atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")
    lines += window_lines(cases, weight, window, 44)
    l2.reset()
    return "\n".join(lines)


if __name__ == "__main__":
    report(f"cupy {cupy.__version__}, {SMS} SMs", measure, (32, 128))

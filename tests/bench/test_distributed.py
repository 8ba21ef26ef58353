"""`embfuse bench --distributed` under torchrun on gloo: the CI smoke run of the sharded step."""

import json
import os
import subprocess
import sys
from pathlib import Path

from embfuse.bench.distributed import overlap_summary
from tests.distributed.worlds import TORCHRUN_TIMEOUT, free_port


def test_the_distributed_bench_runs_under_torchrun_on_gloo(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                          str(free_port()), "-m", "embfuse.cli", "bench", "--distributed", "--device", "cpu",
                          "--batch-size", "32", "--rows", "500", "--dim", "4", "--hotness", "2", "--steps", "2",
                          "--warmup", "1", "--comm-dtype", "bf16", "--compiled", "--profile", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ShardingPlan over 2 rank(s)" in run.stdout and "examples/s" in run.stdout
    result = json.loads((tmp_path / "distributed-2.json").read_text())
    assert result["backend"] == "gloo" and [r["rank"] for r in result["ranks"]] == [0, 1]
    assert result["comm_dtype"] == "bf16" and "pooled rows sent as bf16" in run.stdout
    assert all(r["examples_per_s"] > 0 and 0 < r["comm_share"] < 1 for r in result["ranks"])
    assert all(r["no_exchange_device_us"] > 0 and r["pipelined_host_us"] > 0 for r in result["ranks"])
    assert all(r[k] > 0 for r in result["ranks"] for k in ("compiled_overlap_us", "compiled_functional_us",
                                                           "compiled_functional_reordered_us"))
    assert "functional, Inductor's reordering on" in run.stdout
    for r in result["ranks"]:  # traces on every rank; gloo runs no GPU kernel
        for name in ("plain_device_us", "overlap_pass_device_us"):
            assert r["profile"][name]["kernels"] == 0
            trace = json.loads((tmp_path / "profile" / f"{name}-rank{r['rank']}.json").read_text())
            assert any(e.get("name", "").startswith("ProfilerStep") or e.get("cat") == "cpu_op"
                       for e in trace["traceEvents"])


def _kernel(name, start, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur}


def test_overlap_summary_measures_collectives_beside_other_kernels():
    events = [_kernel("ncclDevKernel_SendRecv", 0, 10), _kernel("ncclDevKernel_SendRecv", 5, 10),  # 0-15
              _kernel("gemm", 12, 6), _kernel("triton_pool", 20, 5),  # beside: 12-15
              _kernel("ncclDevKernel_AllReduce", 22, 10),  # 22-32, beside 22-25
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]  # not a kernel
    s = overlap_summary(events)
    assert s["kernels"] == 5
    assert s["comm_us"] == 25 and s["compute_us"] == 11 and s["comm_beside_compute_us"] == 6
    assert s["hidden_share"] == 6 / 25 and s["gpu_busy_us"] == 30 and s["span_us"] == 32
    assert overlap_summary([])["hidden_share"] == 0.0

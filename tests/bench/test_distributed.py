"""`embfuse bench --distributed` under torchrun on gloo: the CI smoke run of the sharded step."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.distributed.worlds import free_port


def test_the_distributed_bench_runs_under_torchrun_on_gloo(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                          str(free_port()), "-m", "embfuse.cli", "bench", "--distributed", "--device", "cpu",
                          "--batch-size", "32", "--rows", "500", "--dim", "4", "--hotness", "2", "--steps", "2",
                          "--warmup", "1", "--comm-dtype", "bf16", "--compiled", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
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

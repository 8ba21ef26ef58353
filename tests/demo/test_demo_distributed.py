"""`embfuse demo` under torchrun (2 ranks, gloo): sharded, the plain loop and TrainPipeline from
one start give the same per-epoch lines."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.distributed.worlds import free_port


def test_the_demo_runs_sharded_and_pipelined_under_torchrun(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                          str(free_port()), "-m", "embfuse.cli", "demo", "--data", "synthetic", "--samples", "6000",
                          "--rows", "300", "--epochs", "2", "--batch-size", "256", "--device", "cpu", "--out",
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {m[0]: m[1] for m in re.findall(r"(sharded, \w+ +epoch \d): (.*)", run.stdout)}
    assert len(lines) == 4, run.stdout
    for epoch in (1, 2):
        assert lines[f"sharded, plain     epoch {epoch}"] == lines[f"sharded, pipelined epoch {epoch}"]
    result = json.loads((tmp_path / "demo-distributed.json").read_text())
    assert result["world_size"] == 2 and [r["name"] for r in result["results"]] == ["sharded, plain",
                                                                                       "sharded, pipelined"]
    assert all(r["examples_per_s"] > 0 for r in result["results"])

import re
from pathlib import Path

import torch
import torch.nn.functional as F


def test_readme_examples_run_and_say_what_is_true():
    """The README's Python examples run as written (on the GPU when there is one), and what their
    comments state holds: shapes, torch's results, the fused update, the row-wise gradient."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    assert "embfuse" in code
    if not torch.cuda.is_available():
        code = code.replace('"cuda"', '"cpu"')
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    ids, weight = ns["ids"], ns["weight"]
    assert ns["pooled"].shape == (4096, 64)
    torch.testing.assert_close(ns["pooled"], F.embedding_bag(ids, weight, mode="sum"))
    assert ns["rows"].shape == (4096, 20, 64)
    torch.testing.assert_close(ns["rows"], F.embedding(ids, weight))
    assert ns["bag"].weight.grad is None  # the fused optimizer updated the rows in place
    touched = ns["touched"]
    assert bool((touched[1:] > touched[:-1]).all())  # ascending, one entry per row
    assert ns["grads"].shape == (touched.numel(), 64)
    out = ns["out"]
    assert out.values().shape == (2, 12) and out["genres"].shape == (2, 4)
    from torch._dynamo.utils import counters  # one graph for padded batches of any length:

    graphs, embfuse = counters["stats"]["unique_graphs"], ns["embfuse"]
    kjt = embfuse.KeyedJaggedTensor(["f"], torch.arange(11), lengths=torch.tensor([8, 1, 0, 2]))
    ns["graph_step"](embfuse.PaddedKeyedJaggedTensor.from_kjt(kjt, 16).to(ns["tables"].weights.device))
    assert counters["stats"]["unique_graphs"] == graphs
    eager, fast = ns["eager"], ns["fast"]
    assert any(line.startswith("batched 3") for line in fast.embfuse_report)
    torch.testing.assert_close(ns["logits"], eager(ns["batch_ids"], ns["batch_offsets"]), rtol=1e-5, atol=1e-5)
    assert fast.get_submodule("embs.0").weight.shape == eager.embs[0].weight.shape
    assert ns["loss"].shape == () and bool(torch.isfinite(ns["loss"]))  # the captured step's loss


def test_readme_sharded_example_runs_under_torchrun_and_prints_its_plan(tmp_path):
    """The README's sharded example, run as it says: torchrun, 2 ranks (gloo on the CPU)."""
    import os
    import subprocess
    import sys

    from tests.distributed.worlds import TORCHRUN_TIMEOUT, free_port

    root = Path(__file__).parent.parent
    text = (root / "README.md").read_text()
    script = re.search(r"```py\n(# sharded.py\n.*?)```", text, re.S).group(1)
    printed = re.search(r"```py\n# sharded.py\n.*?```\nprints\n```\n(.*?)```", text, re.S).group(1)
    (tmp_path / "sharded.py").write_text(script)
    env = dict(os.environ, PYTHONPATH=str(root / "src"), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                          str(free_port()), str(tmp_path / "sharded.py")], env=env, capture_output=True, text=True,
                         timeout=TORCHRUN_TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == printed

import subprocess
import sys


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_needs_no_triton_and_uses_the_reference():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
sys.meta_path.insert(0, Block())
import torch, embfuse, embfuse._triton as t
assert not t.HAS_TRITON
w = torch.randn(5, 3)
out = embfuse.embedding_bag(torch.tensor([1, 2, 4]), w, torch.tensor([0, 1]), mode="sum")
assert torch.allclose(out, torch.stack([w[1], w[2] + w[4]]))
print("ok")
"""
    r = _run(code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_import_does_not_initialise_cuda():
    r = _run("import torch, embfuse; assert not torch.cuda.is_initialized(); print('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr

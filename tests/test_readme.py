import re
from pathlib import Path

import torch


def test_readme_examples_run():
    """The README's Python examples run as written (on the GPU when there is one)."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    assert "embfuse" in code
    if not torch.cuda.is_available():
        code = code.replace('"cuda"', '"cpu"')
    exec(compile(code, "README.md", "exec"), {})

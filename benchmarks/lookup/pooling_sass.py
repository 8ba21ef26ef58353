"""What the collection's pooling kernel compiles to for sm_90, on a machine without a GPU (Triton's
own ptxas and cuobjdump): registers, SASS instructions, global loads and 16-byte loads of each
form (plain or a batch that skips ids < 0; unweighted or weighted; int64 or int32 ids), at the
shape of a D128 fp32 collection (BLOCK_L 2, BLOCK_D 128, one warp, every feature one width, a
deferred check's status). Pointer and size arguments carry the divisibility by 16 that Triton's
launcher specializes on, as at run time. `dump`: also write that form's SASS and TTGIR to /tmp.

    PYTHONPATH=src python benchmarks/lookup/pooling_sass.py [dump: e.g. skip-u-i64]
"""

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from embfuse.ops.collection import _collection_fwd_kernel as kernel

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_form(skip, weighted, ids):
    sig = dict(weights="*fp32", values=f"*{ids}", offsets="*i64", psw="*fp32" if weighted else "constexpr",
               status="*i32", meta="*i64", out="*fp32", B="i64", stride_o="i64", stride_m="i64",
               ln_w="constexpr", ln_b="constexpr", eps="fp32")
    const = dict(ln_w=None, ln_b=None, HAS_PSW=weighted, WSUM=weighted, SKIP=skip, STATUS=True, FULL=True,
                 BLOCK_L=2, BLOCK_D=128, EVICT="", VEC=4, EPILOGUE=False, ACT=0, HAS_LW=False, HAS_LB=False)
    if not weighted:
        const["psw"] = None
    for name in const:
        sig.setdefault(name, "constexpr")
    aligned = [k for k in ("weights", "values", "offsets", "psw", "status", "meta", "out", "B", "stride_o")
               if sig[k] != "constexpr"]
    at = kernel.arg_names.index
    src = ASTSource(fn=kernel, signature=sig, constexprs={(at(k),): v for k, v in const.items()},
                    attrs={(at(k),): [["tt.divisibility", 16]] for k in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))


def sass(compiled):
    """(SASS text, registers)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    dump = os.path.join(TOOLS, "cuobjdump")
    text = subprocess.run([dump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([dump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    return text, int(re.search(r"REG:(\d+)", usage).group(1))


dump = sys.argv[1] if len(sys.argv) > 1 else None
for skip in (False, True):
    for weighted in (False, True):
        for ids in ("i64", "i32"):
            name = f"{'skip' if skip else 'plain'}-{'w' if weighted else 'u'}-{ids}"
            compiled = compile_form(skip, weighted, ids)
            text, regs = sass(compiled)
            instructions = [line for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
            loads = [line for line in instructions if "LDG" in line]
            print(f"{name}: registers {regs}, instructions {len(instructions)}, global loads {len(loads)}, "
                  f"16-byte {sum('LDG.E.128' in line for line in loads)}")
            if name == dump:
                open(f"/tmp/{name}.sass", "w").write(text)
                open(f"/tmp/{name}.ttgir", "w").write(compiled.asm["ttgir"])

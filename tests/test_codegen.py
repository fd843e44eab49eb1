"""The Triton kernels compile for a real GPU (sm_90) on this CPU-only machine, and their K loops
keep the properties docs/BENCHMARKS.md relies on.

The interpreter tests (test_kernels.py) check what the kernels compute, not what they compile
to: a kernel can pass every interpreter test and still fail to compile for a GPU, spill registers,
or gain a layout conversion in its hot loop. scripts/sass_stats.py compiles every autotune config
with the ptxas shipped in the triton wheel and `--check` rejects spills, shared-memory traffic or
I2F in the M = 1 loop, and tl.dot launches without tensor-core MMAs. It runs in a fresh process
(without importing triton here: compiling needs the real @triton.jit functions, and test_kernels.py
must be the first to import triton in this process, in interpreter mode).
"""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "sass_stats.py")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton unavailable")
@pytest.mark.parametrize("bits,kinds", [(4, []), (3, ["decode", "gemm", "dequant", "codebook", "cbdequant", "trellis",
                                                    "trellismm"]),
                                        (2, ["codebook", "cbdequant", "trellis", "trellismm"])])
def test_kernels_compile_for_sm90_without_spills_or_conversions(bits, kinds):
    """Every kind at 4 bits (the default list: GPTQ, codebook, rotation and trellis kernels); 3 and 2 bits where the
    code width changes what compiles (E8P's 2-bit codes are its main use; the trellis's 3-bit tile spilled once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default the kernels were tuned with
    args = [sys.executable, SCRIPT, "--bits", str(bits), "--check"] + (["--kind", *kinds] if kinds else [])
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if run.returncode == 77:  # sass_stats.NO_TOOLS: a triton wheel without ptxas/cuobjdump
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for kind in kinds or ["m1", "decode", "codebook", "cbdequant", "rotate", "trellis", "trellismm"]:  # what compiled
        assert any(line.startswith(f"| {kind} |") for line in run.stdout.splitlines()), run.stdout

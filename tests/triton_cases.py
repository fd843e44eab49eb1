"""The cpu/cuda parameters of the Triton kernel tests: which flavour this process can run, and why not."""
import os
import subprocess
import sys

import pytest
import torch


def device_params(unavailable, interpret: bool, preimported: bool) -> list:
    """[cpu, cuda] pytest params, each skipped with the reason it cannot run here.

    unavailable: why triton cannot be used at all (None when it imports); interpret: TRITON_INTERPRET=1 was set
    before triton was imported; preimported: another module imported triton first (the interpreter cases
    then run in a fresh process instead)."""
    def param(device):
        reasons = [f"triton unavailable: {unavailable}"] if unavailable else []
        if device == "cpu" and not interpret:
            reasons.append("CPU runs of the Triton kernels need TRITON_INTERPRET=1 before triton is imported"
                           + (" (run in a fresh process instead)" if preimported else " (unset on GPU machines)"))
        if device == "cuda" and (interpret or not torch.cuda.is_available()):
            reasons.append("needs CUDA with compiled (not interpreted) Triton")
        return pytest.param(device, marks=pytest.mark.skipif(bool(reasons), reason="; ".join(reasons)))

    return [param("cpu"), param("cuda")]


def rerun_with_interpreter(path: str, timeout: int) -> None:
    """Run the test file `path` in a new process with TRITON_INTERPRET=1 (for when triton was imported
    without it before the file could turn it on) and fail with its output if it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

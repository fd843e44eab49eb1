"""scripts/gpu_bench.sh, the one command a GPU slot runs (issue 42): its dry run on this CPU goes through every part
(tiny shapes, Triton's interpreter), so nothing of it is debugged on the GPU's clock; and a part whose result is
wrong fails the run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.sh"
PARTS = ("tests", "int4", "formats", "generate", "calibrate-8b", "calibrate")


def run(out: Path, python: str, dry: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": python, "GPU_BENCH_DRY": "1" if dry else "0"}
    env.pop("TRITON_INTERPRET", None)  # the script sets it for its own processes
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)


def test_the_dry_run_goes_through_every_part(tmp_path):
    done = run(tmp_path, sys.executable)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # what a lent machine returns: at most 8 files
        "calibration.json", "calibration_8b.json", "generate.json", "gpu_bench.log", "kernels_formats.json", "kernels_int4.json",
        "summary.txt"]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary[1:]] == list(PARTS)
    assert all(": ok (" in line for line in summary[1:]), summary
    int4 = json.loads((tmp_path / "kernels_int4.json").read_text())
    assert int4["failed"] == [] and {r["format"] for r in int4["rows"]} == {"int4"}
    assert all(r["tinygemm_us"] is not None for r in int4["rows"])
    formats = json.loads((tmp_path / "kernels_formats.json").read_text())
    assert {r["format"] for r in formats["rows"]} == {"int4-asym", "int3", "int8", "int4-rotated", "turboquant4",
                                                      "turboquant3", "e8p2", "trellis2", "trellis3"}
    generate = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert [r["model"] for r in generate] == ["fp32", "int4 g128", "turboquant w4", "e8p w2"]
    calibration = json.loads((tmp_path / "calibration.json").read_text())["rows"]
    assert [r["method"] for r in calibration] == ["gptq", "awq", "turboquant+gptq", "e8+gptq"]
    assert [r.get("agrees") for r in calibration] == [True] * 4  # the real model against its CPU reference
    block = json.loads((tmp_path / "calibration_8b.json").read_text())["rows"]
    assert [(r["method"], r.get("agrees")) for r in block] == [("gptq", None)] and "error" not in block[0]


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script")
def test_a_part_with_a_wrong_result_fails_the_run_and_the_others_still_run(tmp_path):
    """A stand-in Python: the int4 kernels' check fails (exit 1), every other part passes at once."""
    shim = tmp_path / "python"
    shim.write_text(f"""#!/bin/sh
case "$*" in
  *bench_kernels.py*"--formats int4 "*) echo "check int4 FAIL"; exit 1;;
  *scripts/*|*pytest*) exit 0;;
esac
exec {sys.executable} "$@"
""")
    shim.chmod(0o755)
    done = run(tmp_path / "out", str(shim))
    assert done.returncode == 1
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "int4: FAILED (exit 1" in summary and "formats: ok" in summary and "calibrate: ok" in summary
    assert "wrong results in: int4" in done.stdout


def test_the_tests_collect_without_what_the_gpu_image_lacks(tmp_path):
    """The lent GPU machines' image has no gguf (the test extra) and no datasets, and nothing can be installed
    there: every test module must still import (and skip what needs them), or the tests part fails at collection."""
    for name in ("gguf", "datasets"):
        (tmp_path / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           str(tests)], env=env, capture_output=True, text=True, timeout=600, cwd=tests.parent)
    assert done.returncode == 0, done.stdout[-3000:]

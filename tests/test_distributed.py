"""Calibration over torchrun processes (issue 17, quantkit.distributed): 2 gloo ranks write the checkpoint 1 rank
writes; what cannot be spread is refused before any work."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from quantkit.config import QuantConfig
from quantkit.distributed import Group
from quantkit.errors import QuantkitError

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


def quantize_cli(nproc, src, out, text, method):
    args = ["quantize", str(src), "-o", str(out), "--method", method, "--bits", "4", "--group-size", "32",
            "--dataset", str(text), "--nsamples", "6", "--seqlen", "48", "--device", "cpu"]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(out.parent)}
    done = subprocess.run([*launcher, "-m", "quantkit.cli", *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.parametrize("method", ["gptq", "turboquant+gptq"])
def test_two_gloo_ranks_write_what_one_process_writes(model_factory, tmp_path, method):
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(f"Once upon a time there was a little cat number {i} who liked to play." for i in range(300)))
    src = model_factory("llama-gqa")
    quantize_cli(1, src, tmp_path / "one", text, method)
    two = quantize_cli(2, src, tmp_path / "two", text, method)
    assert two.stdout.count("wrote ") == 1  # rank 0 reports, the other rank stays quiet
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "two"))
    assert a.keys() == b.keys()
    for name in a:  # codes equal; the Hessians differ only in float summation order (relative ~1e-7)
        assert torch.equal(a[name], b[name]), name
    ra, rb = (json.loads((tmp_path / d / "quantkit_report.json").read_text())["layers"] for d in ("one", "two"))
    for name in ra:
        assert rb[name]["error"] == pytest.approx(ra[name]["error"], rel=1e-4)


@pytest.mark.parametrize("started_by_caller", [False, True])
def test_quantize_ends_the_process_group_it_started_also_on_failure(monkeypatch, started_by_caller):
    """A rank that exits with its gloo group alive can abort in the teardown (SIGABRT once the work is done, which
    torchrun reports as a failure): quantize() ends the group it started, whatever happens; a group the caller
    started is the caller's to end."""
    import torch.distributed as dist

    from quantkit.api import quantize

    calls, alive = [], [started_by_caller]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: alive[0])
    monkeypatch.setattr(dist, "init_process_group", lambda backend: (calls.append(backend), alive.__setitem__(0, True)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (calls.append("destroy"), alive.__setitem__(0, False)))
    with pytest.raises(QuantkitError, match="--resume"):
        quantize("model", "out", QuantConfig(), device="cpu", resume=True)
    assert calls == ([] if started_by_caller else ["gloo", "destroy"])
    assert alive == [started_by_caller]


def test_samples_split_contiguously_and_too_few_are_refused():
    ids = torch.arange(20).reshape(5, 4)
    shares = [Group(r, 2).split(ids) for r in range(2)]
    assert torch.equal(torch.cat(shares), ids) and [s.shape[0] for s in shares] == [3, 2]
    with pytest.raises(QuantkitError, match="at least one --nsamples per process"):
        Group(0, 8).split(ids)
    assert [Group(0, 3).owner(j) for j in range(4)] == [0, 1, 2, 0]


def test_what_cannot_be_spread_is_refused():
    from quantkit.api import _check_distributed

    with pytest.raises(QuantkitError, match="single process"):
        _check_distributed(QuantConfig(method="awq+gptq"), resume=False)
    with pytest.raises(QuantkitError, match="--resume"):
        _check_distributed(QuantConfig(method="gptq"), resume=True)
    _check_distributed(QuantConfig(method="gptq"), resume=False)

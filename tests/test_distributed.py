"""Calibration over torchrun processes (issue 17, quantkit.calibration.distributed): 2 gloo ranks write the checkpoint 1 rank
writes; what cannot be spread is refused before any work."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from quantkit.run.config import QuantConfig
from quantkit.calibration.distributed import Group
from quantkit.core.errors import QuantkitError

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def calib_text(folder):
    text = folder / "calib.txt"
    text.write_text("\n".join(f"Once upon a time there was a little cat number {i} who liked to play." for i in range(300)))
    return text


def quantize_args(src, out, text, method="gptq"):
    return ["quantize", str(src), "-o", str(out), "--method", method, "--bits", "4", "--group-size", "32",
            "--dataset", str(text), "--nsamples", "6", "--seqlen", "48", "--device", "cpu"]


def run_env(home):
    return {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(home)}


def quantize_cli(nproc, src, out, text, method, launch="torchrun", extra=()):
    """launch: torchrun, or quantkit's own --processes."""
    args = quantize_args(src, out, text, method) + list(extra)
    launcher = [sys.executable]
    if nproc > 1 and launch == "torchrun":
        launcher = [*TORCHRUN, f"--nproc-per-node={nproc}"]
    elif nproc > 1:
        args += ["--processes", str(nproc)]
    done = subprocess.run([*launcher, "-m", "quantkit.cli", *args], capture_output=True, text=True,
                          env=run_env(out.parent), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.parametrize("method,launch,extra", [("gptq", "torchrun", ()), ("turboquant+gptq", "torchrun", ()),
                                                 ("gptq", "--processes", ()), ("gptq", "torchrun", ("--lm-head",)),
                                                 ("gptq", "--processes", ("--target-bits", "3.4"))])
def test_two_gloo_ranks_write_what_one_process_writes(model_factory, tmp_path, method, launch, extra):
    text = calib_text(tmp_path)
    src = model_factory("llama-gqa")
    quantize_cli(1, src, tmp_path / "one", text, method, extra=extra)
    two = quantize_cli(2, src, tmp_path / "two", text, method, launch, extra)
    assert two.stdout.count("wrote ") == 1  # rank 0 reports, the other rank stays quiet
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "two"))
    assert a.keys() == b.keys()
    for name in a:  # codes equal; the Hessians differ only in float summation order (relative ~1e-7)
        assert torch.equal(a[name], b[name]), name
    recipes = {(tmp_path / d / "quantkit_recipe.yaml").read_text() for d in ("one", "two")}
    assert len(recipes) == 1  # with --target-bits: rank 0's allocation, run by both ranks
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
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, timeout=None: (calls.append(backend), alive.__setitem__(0, True)))
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
    from quantkit.calibration.distributed import check_supported

    with pytest.raises(QuantkitError, match="single process"):
        check_supported(QuantConfig(method="awq+gptq"), resume=False)
    with pytest.raises(QuantkitError, match="--resume"):
        check_supported(QuantConfig(method="gptq"), resume=True)
    check_supported(QuantConfig(method="gptq"), resume=False)


def test_processes_option_refuses_before_starting_any(tmp_path, monkeypatch):
    """Every refusal of --processes comes from the launching process, before N model loads: nothing is started
    (the launcher is replaced by a failure) and nothing is written."""
    from click.testing import CliRunner

    from quantkit.calibration import distributed
    from quantkit.cli import main

    monkeypatch.setattr(distributed, "launch_local", lambda *a: pytest.fail("a process was started"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    base = ["quantize", "model", "--method", "gptq", "--processes", "2", "--device", "cpu"]
    cases = {"--method awq cannot be spread": ["-o", str(tmp_path / "a"), "--method", "awq"],
             "--resume is not supported": ["-o", str(tmp_path / "a"), "--resume"],
             "--nsamples 1 cannot be shared by 2": ["-o", str(tmp_path / "a"), "--nsamples", "1"],
             "already exists": ["-o", str(tmp_path / "taken")],
             "does not exist: check the path passed to --dataset": ["-o", str(tmp_path / "a"), "--dataset",
                                                                    str(tmp_path / "missing.txt")]}
    for message, extra in cases.items():
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code == 2 and message in result.output, result.output
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(main, base + ["-o", str(tmp_path / "a")])
    assert result.exit_code == 2 and "under torchrun leave it out" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_processes_need_one_gpu_each_and_the_whole_cuda_device():
    from quantkit.calibration.distributed import launch_local

    with pytest.raises(QuantkitError, match="give --device cuda"):
        launch_local(2, ["quantize"], "cuda:1")
    with pytest.raises(QuantkitError, match=f"this machine has {torch.cuda.device_count()}"):
        launch_local(torch.cuda.device_count() + 1, ["quantize"], "cuda")


def test_the_processes_get_the_command_without_processes():
    from quantkit.calibration.distributed import without_option

    argv = ["quantize", "m", "--processes", "2", "-o", "out", "--processes=3", "--seqlen", "8"]
    assert without_option(argv, "--processes") == ["quantize", "m", "-o", "out", "--seqlen", "8"]


def test_a_data_free_method_with_processes_runs_as_one(model_factory, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import main

    result = CliRunner().invoke(main, ["quantize", str(model_factory("llama-gqa")), "-o", str(tmp_path / "q"),
                                       "--method", "rtn", "--processes", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "running as one process" in result.output and (tmp_path / "q" / "model.safetensors").exists()


def test_results_sent_between_processes_land_on_the_receivers_device():
    """Pickled as they are, the tensors of a result quantized on cuda:0 would come back on cuda:0 in the process
    of cuda:1; what Group.broadcast sends is rebuilt on the receiver's device (meta stands in for another GPU)."""
    from quantkit.calibration.distributed import from_bytes, to_bytes
    from quantkit.schemes.grid import Grid
    from quantkit.core.result import QuantResult

    res = QuantResult(torch.zeros(4, 8, dtype=torch.int32), {"scale": torch.ones(4, 1)}, torch.zeros(8, dtype=torch.int32),
                      Grid(4, True), 8, stats={"error": 0.5})
    got = from_bytes(to_bytes(res), "meta")
    assert got.codes.device.type == got.params["scale"].device.type == got.g_idx.device.type == "meta"
    assert got.codes.shape == (4, 8) and got.stats == {"error": 0.5} and got.quantizer.bits == 4
    same = from_bytes(to_bytes(res), "cpu")
    assert torch.equal(same.codes, res.codes) and torch.equal(same.params["scale"], res.params["scale"])


def killed_then_resumed(model_factory, tmp_path, script: str, *script_args):
    """tmp_path/one written by one process; a 2-rank torchrun of `script` (the CLI with a rank killed) writing
    tmp_path/two, which it leaves unfinished; then the same command as one process with --resume. Asserts that
    this finishes the checkpoint one process writes (byte-identical on this model, as the uninterrupted 2-process
    run is; the report's errors differ in the Hessians' last bits). Returns (killed run, resumed run)."""
    text, src, out = calib_text(tmp_path), model_factory("llama-gqa"), tmp_path / "two"
    quantize_cli(1, src, tmp_path / "one", text, "gptq")
    killer = tmp_path / "killer.py"
    killer.write_text(script)
    args = quantize_args(src, out, text)
    # The launcher looks at its workers every 2 s (not every 0.1 s): a rank that dies is then met by its peer's
    # collective, which these tests are about, before the launcher stops that peer with SIGTERM (a race the
    # launcher won once in CI, when the peer was between two collectives).
    killed = subprocess.run([*TORCHRUN, "--monitor-interval=2", "--nproc-per-node=2", str(killer), *script_args,
                             *args], capture_output=True, text=True, env=run_env(tmp_path), timeout=600)
    assert killed.returncode != 0
    left = list(tmp_path.glob(".two.tmp-*"))
    assert len(left) == 1 and len(list(left[0].glob("part-block-*.safetensors"))) == 1 and not out.exists()
    resumed = subprocess.run([sys.executable, "-m", "quantkit.cli", *args, "--resume"], capture_output=True,
                             text=True, env=run_env(tmp_path), timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "one").iterdir())
    for name in files:
        if name != "quantkit_report.json":
            assert (out / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    return killed, resumed


def test_a_killed_multi_process_run_resumes_as_one_process(model_factory, tmp_path):
    """Rank 0 (the writer) SIGKILLed after writing block 0: the launcher stops the other rank; one process
    resumes the run."""
    from test_resume import KILLER

    _, resumed = killed_then_resumed(model_factory, tmp_path, KILLER, "block-00000")
    assert "block 0 of 2 is done" in resumed.stderr


def test_an_interrupted_multi_process_run_says_to_resume_as_one(monkeypatch):
    from quantkit.run.output import _resume_hint

    assert _resume_hint() == "run the same command with --resume"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "as one process (without --processes or torchrun) with --resume" in _resume_hint()


PEER_KILLER = """
import os, signal, sys
from quantkit.calibration import distributed
from quantkit.cli import main
broadcast, calls = distributed.Group.broadcast, []
def broadcast_then_die(self, obj, src):
    calls.append(src)
    if self.rank == 1 and len(calls) == 12:  # in block 1 (7 linears a block)
        os.kill(os.getpid(), signal.SIGKILL)
    return broadcast(self, obj, src)
distributed.Group.broadcast = broadcast_then_die
main(sys.argv[1:])
"""


def test_a_process_killed_mid_run_leaves_the_writer_one_line_and_its_blocks(model_factory, tmp_path):
    """Rank 1 SIGKILLed (the out-of-memory killer's way) while the layers of block 1 are exchanged: rank 0's
    collective fails in gloo; it says so in one line (no traceback) and keeps block 0 for --resume, as after
    Ctrl-C. (Should the launcher's SIGTERM reach rank 0 first, rank 0 says it was interrupted instead, with the
    same blocks kept and the same advice: either line is right.)"""
    killed, _ = killed_then_resumed(model_factory, tmp_path, PEER_KILLER)
    traced = [line for line in killed.stderr.splitlines() if 'File "' in line and "quantkit" in line]
    assert not traced, killed.stderr[-3000:]  # (torchrun's own launcher prints a traceback of its frames)
    collective_failed = ("error: another process of the run stopped while sending the quantized layers" in killed.stderr
                         and "stopped: the 1 of 2 blocks finished are kept" in killed.stderr)
    launcher_stopped = "interrupted: the 1 of 2 blocks finished are kept" in killed.stderr
    assert collective_failed or launcher_stopped, killed.stderr[-3000:]
    assert "as one process (without --processes or torchrun) with --resume" in killed.stderr


def test_a_failed_collective_is_one_line_and_out_of_memory_stays_itself():
    from quantkit.calibration.distributed import _collective
    from quantkit.core.errors import StoppedFromOutside

    gloo = RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:40122: Connection reset by peer. "
                        "This is typically caused by a remote worker hanging")
    with pytest.raises(StoppedFromOutside, match=r"while summing \(Read error \[127.0.0.1\]:40122: Connection reset by "
                                                 r"peer\); the lines around"):
        with _collective("summing"):
            raise gloo
    with pytest.raises(torch.OutOfMemoryError):
        with _collective("summing"):
            raise torch.OutOfMemoryError("CUDA out of memory")


def test_tokens_routed_to_each_expert_are_counted_over_all_ranks(model_factory, tmp_path):
    """Each rank counts the tokens routed to each expert in its share of the samples; the report sums them."""
    text = calib_text(tmp_path)
    src = model_factory("mixtral")
    quantize_cli(1, src, tmp_path / "one", text, "gptq")
    quantize_cli(2, src, tmp_path / "two", text, "gptq")
    ra, rb = (json.loads((tmp_path / d / "quantkit_report.json").read_text())["layers"] for d in ("one", "two"))
    one, two = ({n: layer["routed_tokens"] for n, layer in r.items() if n.endswith(".w1")} for r in (ra, rb))  # gate_proj
    assert one.keys() == two.keys() and len(one) == 8
    for block in ("model.layers.0.", "model.layers.1."):  # every token reaches top_k = 2 experts in either run
        assert sum(n for name, n in two.items() if name.startswith(block)) == 6 * 48 * 2
    # block 0 reads the same inputs in both runs; block 1 reads them after block 0's quantization, whose float sums
    # differ in order between the runs, so a token at a near tie may go to another expert
    assert {n: c for n, c in two.items() if ".layers.0." in n} == {n: c for n, c in one.items() if ".layers.0." in n}

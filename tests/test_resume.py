"""--resume (issue 17): a run killed at a block and resumed writes the checkpoint an uninterrupted run writes,
byte for byte; a resume with other settings or a changed source is refused; a partial run is never silently
deleted or reused."""
import errno
import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from quantkit import api
from quantkit.run.block_writer import BlockWriter
from quantkit.cli import main
from quantkit.run.config import QuantConfig
from quantkit.core.errors import StoppedFromOutside
from quantkit.run import output
from quantkit.checkpoint import shards
from tiny_models import make_model_folder

CALIB = ["--dataset", "CALIB", "--nsamples", 2, "--seqlen", 16]
# a test-only child: the CLI, killed with SIGKILL right after it saved the part named by argv[1]
KILLER = """
import os, signal, sys
from quantkit.checkpoint import shards
from quantkit.cli import main
save, key = shards.save_part, sys.argv[1]
def save_then_die(folder, k, tensors, info=None):
    save(folder, k, tensors, info)
    if k == key:
        os.kill(os.getpid(), signal.SIGKILL)
shards.save_part = save_then_die
main(sys.argv[2:])
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A 4-block fp16 Llama with biases (so exact fp32 copies of the in-loop tensors are needed) and a
    calibration text file, in a fresh folder."""
    root = tmp_path_factory.mktemp("resume")
    src = make_model_folder("llama-deep", root, dtype=torch.float16)
    (root / "calib.txt").write_text("\n".join(f"Once upon a time a little fox number {i} found a red ball and "
                                              "played with it all day long in the sun." for i in range(20)))
    return root, src


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def args_for(world, out, method, *extra):
    root, src = world
    calib = [str(root / "calib.txt") if a == "CALIB" else a for a in CALIB] if method != "rtn" else []
    return ["quantize", src, "-o", out, "--method", method, "--group-size", 32, "--max-shard-size", "20KB", *calib,
            *extra]


def killed(world, out, key, argv):
    """Run the CLI in a child killed after it saved part `key`; the staging folder it left."""
    proc = subprocess.run([sys.executable, "-c", KILLER, key, *[str(a) for a in argv]], cwd=world[0],
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = sorted(out.parent.glob(f".{out.name}.tmp-*"))
    assert len(left) == 1 and not out.exists(), left
    return left[0]


def assert_same_checkpoint(a, b):
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name != api.REPORT_NAME:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ra, rb = (json.loads((f / api.REPORT_NAME).read_text()) for f in (a, b))
    strip = lambda layers: {n: {k: v for k, v in r.items() if k != "seconds"} for n, r in layers.items()}  # noqa: E731
    assert strip(ra["layers"]) == strip(rb["layers"]) and ra["files"] == rb["files"]
    assert ra.get("awq") == rb.get("awq") and ra["flagged"] == rb["flagged"]


@pytest.mark.parametrize("method,key", [("rtn", "block-00001"), ("gptq", "block-00002"), ("gptq", "top-00000")])
def test_sigkilled_run_resumes_to_a_byte_identical_checkpoint(world, method, key):
    root = world[0]
    ref, out = root / f"ref-{method}-{key}", root / f"out-{method}-{key}"
    assert cli(*args_for(world, ref, method)).exit_code == 0
    assert len(list(ref.glob("model-*.safetensors"))) > 1  # a sharded checkpoint, with its index
    left = killed(world, out, key, args_for(world, out, method))
    done = int(key.split("-")[1]) + 1 if key.startswith("block") else 4
    assert len(list(left.glob("part-block-*.safetensors"))) == done

    again = cli(*args_for(world, out, method))  # without --resume: reported, left alone
    assert again.exit_code == 2 and "--resume" in again.output and left.name in again.output, again.output
    assert left.is_dir() and not out.exists()

    result = cli(*args_for(world, out, method, "--resume"))
    assert result.exit_code == 0, result.output
    assert f"blocks 0-{done - 1} of 4 are done" in result.output
    assert not list(root.glob(".out-*"))  # the adopted staging folder became OUT
    assert_same_checkpoint(ref, out)
    assert json.loads((out / api.REPORT_NAME).read_text())["resumed_at_block"] == done


@pytest.mark.parametrize("key,done", [("block-00003", "blocks 0-3 of 4 are done"),
                                      ("block-00004", "blocks 0-3 of 4 and lm_head are done")])
def test_a_run_quantizing_lm_head_resumes_to_a_byte_identical_checkpoint(world, key, done):
    """lm_head's part follows the last block's: killed before it, the resumed run replays every block to calibrate
    it; killed after it, only the outside tensors are left to write."""
    root = world[0]
    ref, out = root / f"ref-head-{key}", root / f"out-head-{key}"
    assert cli(*args_for(world, ref, "gptq", "--lm-head")).exit_code == 0
    killed(world, out, key, args_for(world, out, "gptq", "--lm-head"))
    result = cli(*args_for(world, out, "gptq", "--lm-head", "--resume"))
    assert result.exit_code == 0, result.output
    assert done in result.output
    assert_same_checkpoint(ref, out)


@pytest.mark.parametrize("stop,code,words", [
    (KeyboardInterrupt, 1, "interrupted: the 2 of 4 blocks finished are kept"),  # Ctrl-C, SIGTERM; click: Aborted!
    (MemoryError, 1, "out of memory: the 2 of 4 blocks finished are kept"),
    (OSError(errno.ENOSPC, "No space left on device"), 2, "no space left on the device; the 2 of 4 blocks finished"),
    (StoppedFromOutside("another process of the run stopped"), 2, "stopped: the 2 of 4 blocks finished are kept"),
])
def test_a_run_stopped_from_outside_keeps_its_blocks_and_says_how_to_continue(world, stop_at_part, stop, code,
                                                                               words):
    root = world[0]
    out = root / f"stopped-{stop.__name__ if isinstance(stop, type) else type(stop).__name__}"
    with stop_at_part("block-00002", stop):
        result = cli(*args_for(world, out, "rtn"))
    assert result.exit_code == code and words in result.output and "--resume" in result.output, result.output
    assert not out.exists()
    assert cli(*args_for(world, out, "rtn", "--resume")).exit_code == 0
    assert (out / "config.json").is_file() and not list(root.glob(f".{out.name}.*"))


def test_an_error_of_the_run_itself_deletes_its_staging(world, monkeypatch):
    root = world[0]
    save = shards.save_part

    def fail_at_block_2(folder, key, tensors, info=None):
        if key == "block-00002":
            raise api.QuantkitError("a NaN, say")
        save(folder, key, tensors, info)

    monkeypatch.setattr(shards, "save_part", fail_at_block_2)
    result = cli(*args_for(world, root / "failed", "rtn"))
    assert result.exit_code == 2 and "a NaN, say" in result.output
    assert not list(root.glob(".failed.*")) and not (root / "failed").exists()


def interrupted(stop_at_part, argv, key="block-00001"):
    """Run the CLI in this process, interrupted (Ctrl-C) when it is about to save part `key`."""
    with stop_at_part(key):
        assert cli(*argv).exit_code == 1


@pytest.mark.parametrize("change,words", [
    (["--bits", 3], ["--bits 4 -> 3"]),
    (["--seed", 1], ["--seed 0 -> 1", "calibration token ids changed"]),
    ("source", ["model.safetensors changed"]),
])
def test_resume_with_other_settings_or_a_changed_source_is_refused(world, tmp_path, stop_at_part, change, words):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(world[1], src)
    out = tmp_path / "out"
    argv = ["quantize", src, "-o", out, "--method", "gptq", "--group-size", 32, "--dataset", world[0] / "calib.txt",
            "--nsamples", 2, "--seqlen", 16]
    interrupted(stop_at_part, argv)
    (left,) = tmp_path.glob(".out.tmp-*")
    before = {p.name: p.read_bytes() for p in left.iterdir()}
    if change == "source":  # the model downloaded again, one weight different
        tensors = load_file(src / "model.safetensors")
        tensors["model.layers.3.mlp.down_proj.weight"][0, 0] += 1
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
        change = []
    result = cli(*argv, *change, "--resume")
    assert result.exit_code == 2 and "cannot resume" in result.output and "Traceback" not in result.output
    for w in words:
        assert w in result.output, result.output
    assert {p.name: p.read_bytes() for p in left.iterdir()} == before and not out.exists()


def test_resume_without_a_partial_run_starts_from_block_0(world):
    out = world[0] / "fresh"
    result = cli(*args_for(world, out, "rtn", "--resume"))
    assert result.exit_code == 0 and "no interrupted run" in result.output


@pytest.mark.parametrize("method,extra", [
    ("gptq", []), ("awq", []), ("gptq", ["--rotate", "hadamard"]), ("turboquant+gptq", ["--bits", 3]),
    ("e8+gptq", ["--bits", 2, "--group-size", 32]), ("awq", ["--checkpoint-format", "awq"]),
    ("gptq", ["--checkpoint-format", "compressed-tensors", "--asym"]),
])
def test_replay_rebuilds_each_block_bit_for_bit(world, tmp_path, monkeypatch, method, extra):
    """Every block read back from its part (what --resume forwards) equals the block the run computed with."""
    compared = []
    save = BlockWriter.save_block

    def save_and_replay(self, tmp, i, block, results):
        live = {k: v.clone() for k, v in block.state_dict().items()}
        save(self, tmp, i, block, results)
        self.folder, self.device = tmp, "cpu"
        replayed = self.replay(i).state_dict()
        for k, v in live.items():
            assert v.dtype == replayed[k].dtype and torch.equal(v, replayed[k]), (i, k)
        compared.append(i)

    monkeypatch.setattr(BlockWriter, "save_block", save_and_replay)
    small = (world[0], make_model_folder("llama-tied-bias", tmp_path, dtype=torch.float16))  # 2 blocks, tied
    result = cli(*args_for(small, tmp_path / "out", method, *extra))
    assert result.exit_code == 0, result.output
    assert compared == [0, 1]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_part_is_set_aside_and_redone_and_the_good_ones_kept(world, monkeypatch, damage, stop_at_part):
    """A part a copy or a failing disk damaged: named, set aside and made again; block 0's part is kept as it was
    and the checkpoint is the uninterrupted run's."""
    root = world[0]
    ref, out = root / f"ref-damaged-{damage}", root / f"damaged-{damage}"
    assert cli(*args_for(world, ref, "gptq")).exit_code == 0
    interrupted(stop_at_part, args_for(world, out, "gptq"), key="block-00002")
    (left,) = root.glob(f".{out.name}.tmp-*")
    part = left / "part-block-00001.safetensors"
    part.write_bytes(part.read_bytes()[:-100] if damage == "truncated" else b"\x00" * 64)
    kept = (left / "part-block-00000.safetensors").read_bytes()
    reads = []
    read = shards.read_part
    monkeypatch.setattr(shards, "read_part", lambda folder, key, **kw: reads.append(key) or read(folder, key, **kw))
    result = cli(*args_for(world, out, "gptq", "--resume"))
    assert result.exit_code == 0, result.output
    assert "part-block-00001.safetensors" in result.output and "is damaged" in result.output
    assert "block 0 of 4 is done" in result.output
    assert "block-00000" in reads  # block 0 came from its part, not quantized again
    assert_same_checkpoint(ref, out)
    assert not list(out.glob("damaged-*")) and kept


def test_an_error_in_a_resumed_run_keeps_the_earlier_runs_blocks(world, monkeypatch, stop_at_part):
    root = world[0]
    out = root / "resumed-then-failed"
    interrupted(stop_at_part, args_for(world, out, "rtn"), key="block-00002")
    save = shards.save_part

    def fail_at_block_3(folder, key, tensors, info=None):
        if key == "block-00003":
            raise api.QuantkitError("a NaN, say")
        save(folder, key, tensors, info)

    with monkeypatch.context() as m:
        m.setattr(shards, "save_part", fail_at_block_3)
        result = cli(*args_for(world, out, "rtn", "--resume"))
    assert result.exit_code == 2 and "a NaN, say" in result.output
    assert "the 3 of 4 blocks finished are kept" in result.output and "--resume" in result.output, result.output
    (left,) = root.glob(f".{out.name}.tmp-*")
    assert len(list(left.glob("part-block-*"))) == 3
    assert cli(*args_for(world, out, "rtn", "--resume")).exit_code == 0


def test_a_source_replaced_during_the_run_stops_it(world, tmp_path, monkeypatch):
    """The source's safetensors replaced mid-run (same shapes, other values): the run stops instead of writing a
    checkpoint whose first blocks come from one model and the rest from the other."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(world[1], src)
    save = shards.save_part

    def replace_source_after_block_0(folder, key, tensors, info=None):
        save(folder, key, tensors, info)
        if key == "block-00000":
            other = {k: v * 1.5 for k, v in load_file(src / "model.safetensors").items()}
            save_file(other, src / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(shards, "save_part", replace_source_after_block_0)
    result = cli("quantize", src, "-o", tmp_path / "q", "--method", "rtn", "--group-size", 32)
    assert result.exit_code == 2 and "model.safetensors changed while this run was reading it" in result.output
    assert not (tmp_path / "q").exists() and "Traceback" not in result.output


def test_resume_takes_the_same_calibration_file_by_another_name(world, tmp_path, monkeypatch, stop_at_part):
    """The calibration file given by a relative path in one run and an absolute one in the next is the same file."""
    root = world[0]
    out = tmp_path / "out"
    monkeypatch.chdir(root)
    relative = args_for(world, out, "gptq")
    relative[relative.index(str(root / "calib.txt"))] = "calib.txt"
    interrupted(stop_at_part, relative)
    result = cli(*args_for(world, out, "gptq", "--resume"))
    assert result.exit_code == 0 and "block 0 of 4 is done" in result.output, result.output

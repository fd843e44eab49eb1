"""Destructive paths: every writing command (quantize, demo) against user folders, the source, `.`, a file,
links and stale staging folders, with and without --overwrite. The file system must be byte-for-byte
unchanged after a refusal, and a replaced checkpoint must be the only change after a success."""
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

import quantkit.demo
from quantkit.cli import main
from quantkit.checkpoint import files as checkpoint, shards
from quantkit.run import output


def snapshot(root):
    """Every path under root (hidden ones too) -> (kind, bytes, mode)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                state[rel] = ("link", os.readlink(path), None)
            elif os.path.isdir(path):
                state[rel] = ("dir", None, os.stat(path).st_mode)
            else:
                with open(path, "rb") as f:
                    state[rel] = ("file", f.read(), os.stat(path).st_mode)
    return state


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_refused(result, *words):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("error: "), result.output
    for w in words:
        assert w in result.output, result.output


@pytest.fixture
def world(tmp_path, model_factory, monkeypatch):
    """tmp_path holding a source model, a folder of user files and a plain file; cwd = tmp_path.

    The demo's bundled model is pointed at the copy in this world, so a wrong refusal cannot touch the package."""
    src = tmp_path / "src"
    shutil.copytree(model_factory("llama"), src)
    user = tmp_path / "user"
    (user / "docs").mkdir(parents=True)
    (user / "docs" / "notes.md").write_text("my notes")
    (user / ".bashrc").write_text("export PS1=$")
    (tmp_path / "file.txt").write_text("a file")
    monkeypatch.setattr(quantkit.demo, "bundled_model_path", lambda: src)
    monkeypatch.chdir(tmp_path)
    return tmp_path


WRITERS = {
    "quantize": lambda out, *extra: run("quantize", "src", "-o", out, "--bits", 4, "--group-size", 32, *extra),
    "demo": lambda out, *extra: run("demo", "-o", out, "--tokens", 512, *extra),
}


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("target,words", [
    ("user", ["user"]),                       # a folder of user files
    ("src", ["source model folder"]),         # the source itself
    ("src/sub", ["lies inside the source"]),  # inside the source
    (".", ["-o ."]),                          # the working directory (it contains the source too)
    ("file.txt", ["is a file"]),              # a plain file
])
def test_refused_and_untouched(world, writer, overwrite, target, words):
    before = snapshot(world)
    result = WRITERS[writer](target, *(["--overwrite"] if overwrite else []))
    assert_refused(result, *words)
    assert snapshot(world) == before


def test_overwrite_names_the_foreign_files(world):
    before = snapshot(world)
    assert_refused(WRITERS["quantize"]("user", "--overwrite"), "did not write", ".bashrc", "docs")
    assert snapshot(world) == before


def test_folder_containing_the_source_is_refused(world):
    (world / "parent").mkdir()
    shutil.move(str(world / "src"), world / "parent" / "src")
    before = snapshot(world)
    assert_refused(run("quantize", "parent/src", "-o", "parent", "--overwrite"), "contains the source")
    assert snapshot(world) == before


def test_current_directory_is_refused_even_without_a_source_inside(world, tmp_path_factory, monkeypatch):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "inner").mkdir()
    (elsewhere / "inner" / "keep.txt").write_text("keep")
    monkeypatch.chdir(elsewhere / "inner")
    before = snapshot(elsewhere)
    assert_refused(run("quantize", world / "src", "-o", ".", "--overwrite"), "current directory")
    assert_refused(run("quantize", world / "src", "-o", elsewhere, "--overwrite"), "current directory")
    assert snapshot(elsewhere) == before


def test_symlink_is_refused(world):
    (world / "link").symlink_to(world / "user")
    before = snapshot(world)
    assert_refused(WRITERS["quantize"]("link", "--overwrite"), "symbolic link")
    assert snapshot(world) == before


@pytest.mark.parametrize("writer", WRITERS)
def test_writes_new_and_empty_folders_and_replaces_only_its_own(world, writer):
    assert WRITERS[writer]("out").exit_code == 0
    (world / "empty").mkdir()
    assert WRITERS[writer]("empty").exit_code == 0 and (world / "empty" / "config.json").is_file()
    before = snapshot(world)
    assert_refused(WRITERS[writer]("out"), "already exists", "--overwrite")   # ours, but no --overwrite
    assert snapshot(world) == before
    result = WRITERS[writer]("out", "--overwrite")
    assert result.exit_code == 0, result.output
    after = snapshot(world)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert changed and all(k.startswith("out") for k in changed)  # nothing else touched
    assert not [p for p in world.iterdir() if p.name.startswith(".")]  # no staging left
    assert "note:" not in result.output  # a run never mistakes its own staging folder for a stale one


def test_checkpoint_with_a_user_file_added_is_not_replaced(world):
    assert WRITERS["quantize"]("out").exit_code == 0
    (world / "out" / "README.md").write_text("my model card")
    before = snapshot(world)
    assert_refused(WRITERS["quantize"]("out", "--overwrite"), "README.md")
    assert snapshot(world) == before


def test_files_get_normal_permissions(world):
    old = os.umask(0o022)
    try:
        assert WRITERS["quantize"]("out").exit_code == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (world / "out").iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_interrupt_while_writing_keeps_the_old_checkpoint(world, monkeypatch):
    assert WRITERS["quantize"]("out").exit_code == 0
    before = snapshot(world)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(shards, "assemble", interrupted)
        result = WRITERS["quantize"]("out", "--overwrite")
    assert isinstance(result.exception, KeyboardInterrupt) or result.exit_code != 0
    # OUT and everything else as it was; the finished blocks are kept, hidden, for --resume (issue 17)
    after = snapshot(world)
    (kept,) = {p.split("/")[0] for p in set(after) - set(before)}
    assert kept.startswith(".out.tmp-") and "--resume" in result.output
    assert {p: v for p, v in after.items() if not p.startswith(kept)} == before
    assert WRITERS["quantize"]("out", "--overwrite", "--resume").exit_code == 0
    assert not (world / kept).exists() and (world / "out" / "config.json").is_file()


def test_interrupt_of_a_writer_that_cannot_resume_cleans_up(world, monkeypatch):
    before = snapshot(world)

    save = shards.save_part

    def interrupted(folder, key, tensors, info=None):
        if key == "block-00001":
            raise KeyboardInterrupt
        save(folder, key, tensors, info)

    monkeypatch.setattr(shards, "save_part", interrupted)
    result = WRITERS["demo"]("out")
    assert isinstance(result.exception, KeyboardInterrupt) or result.exit_code != 0
    assert snapshot(world) == before


def test_sigterm_while_writing_cleans_up(world):
    before = snapshot(world)
    with pytest.raises(KeyboardInterrupt):
        with output.staged_folder(world / "out", overwrite=False) as tmp:
            (tmp / "config.json").write_text("{}")
            os.kill(os.getpid(), signal.SIGTERM)
    assert snapshot(world) == before


def test_disk_full_is_one_error_line_and_nothing_written(world, monkeypatch):
    def full(path, tensors, metadata=None):  # the first file a streamed run writes: block 0's part
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(shards, "write_file", full)
    before = snapshot(world)
    assert_refused(WRITERS["quantize"]("out"), "no space left")
    assert snapshot(world) == before


def test_disk_full_in_safetensors_is_one_error_line(world, monkeypatch):
    def full(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        from safetensors import SafetensorError
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", full)  # convert writes with safetensors itself
    assert WRITERS["quantize"]("out").exit_code == 0
    before = snapshot(world)
    result = run("convert", "out", "-o", "converted", "--checkpoint-format", "gptq_v2")
    assert_refused(result, "no space left")
    assert snapshot(world) == before


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def stale(world, kind, pid, marked=True):
    folder = world / f".out.{kind}-{pid}"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"half written")
    if marked:
        (folder / output.STAGING_MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    return folder


def test_stale_staging_of_a_dead_run_is_removed_and_reported(world):
    leftover = stale(world, "tmp", dead_pid())
    result = WRITERS["quantize"]("out")
    assert result.exit_code == 0, result.output
    assert "removed" in result.output and leftover.name in result.output
    assert not leftover.exists()


def test_staging_that_is_not_provably_a_dead_run_is_left_and_reported(world):
    unmarked = stale(world, "tmp", dead_pid(), marked=False)
    result = WRITERS["quantize"]("out")
    assert result.exit_code == 0, result.output
    assert unmarked.is_dir() and str(unmarked) in result.output


def test_staging_of_a_live_process_of_this_host_refuses_the_run(world):
    alive = stale(world, "tmp", os.getppid())
    assert_refused(WRITERS["quantize"]("out"), "is writing", "delete the folder")
    assert alive.is_dir()


def test_run_killed_between_the_renames_is_restored(world):
    assert WRITERS["quantize"]("out").exit_code == 0
    pid = dead_pid()
    old = world / f".out.old-{pid}"
    (world / "out").rename(old)  # what a kill between `out -> old` and `tmp -> out` leaves
    (old / output.STAGING_MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    result = WRITERS["quantize"]("out")  # puts the old checkpoint back, then refuses to replace it
    assert_refused(result, "already exists")
    assert "restored" in result.output and not old.exists()
    assert (world / "out" / "config.json").is_file() and not (world / "out" / output.STAGING_MARKER).exists()


@pytest.mark.parametrize("code,target,words", [
    (errno.EACCES, "out", ["no permission"]),
    (errno.EIO, "new/deeper/out", ["could not write"]),  # and the parents it made are removed again
])
def test_write_errors_are_one_line_and_leave_nothing(world, monkeypatch, code, target, words):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(shards, "assemble", fail)  # the step that writes the shards of a streamed run
    before = snapshot(world)
    assert_refused(WRITERS["quantize"](target), *words)
    assert snapshot(world) == before


def test_sigkilled_writer_is_cleaned_up_by_the_next_run(world):
    code = ("import sys, time\nfrom quantkit.run.output import staged_folder\n"
            "with staged_folder(sys.argv[1], overwrite=False) as tmp:\n"
            "    (tmp / 'model.safetensors').write_bytes(b'half')\n    print('ready', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(world / "out")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait()
    leftover = world / f".out.tmp-{proc.pid}"
    assert leftover.is_dir()  # SIGKILL: no cleanup possible
    result = WRITERS["quantize"]("out")
    assert result.exit_code == 0 and "removed" in result.output
    assert not leftover.exists() and (world / "out" / "config.json").is_file()


def test_a_second_writer_to_an_out_being_written_stops_at_once(world):
    """Another quantkit process of this host stages OUT right now: the second run is refused before any work, and
    the first one's folder is left alone."""
    code = ("import sys, time\nfrom quantkit.run.output import staged_folder\n"
            "with staged_folder(sys.argv[1], overwrite=False) as tmp:\n"
            "    print('ready', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(world / "busy")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        result = WRITERS["quantize"]("busy")
        assert result.exit_code == 2 and f"another quantkit run (pid {proc.pid}) is writing" in result.output
        assert (world / f".busy.tmp-{proc.pid}").is_dir() and not (world / "busy").exists()
    finally:
        proc.kill()
        proc.wait()

"""Where quantkit may write: one rule for every command that writes a checkpoint folder.

The rule (`claim_output` before any heavy work, `check_output` again just before the final rename):
- OUT must be a folder path: an existing file or symbolic link at OUT is refused, with or without
  --overwrite (replacing a link would replace whatever it points to).
- OUT may not be, contain or sit inside a source folder (the model being quantized), nor be or
  contain the current working directory.
- An existing OUT is left alone unless it is empty, or --overwrite is given AND OUT is a checkpoint
  that quantkit wrote: quantkit_report.json lists every file quantkit put there (`files`), and OUT
  holds nothing else. A folder holding anything else (user files, sub-folders, a checkpoint made
  by another tool or an older quantkit) is never deleted; the error names what is in the way.

Writing (`staged_folder`): everything goes into a hidden staging folder next to OUT
(`.OUT.tmp-PID`, marked with STAGING_MARKER) that is renamed to OUT at the end; an existing OUT is
first renamed to `.OUT.old-PID` and deleted only once the new folder is in place. A failure
deletes the staging folder and leaves OUT as it was. A run that was killed outright cannot
clean up, so every write first looks for staging folders of OUT left by dead quantkit processes on
this host: it deletes a dead run's `.tmp` folder, deletes its `.old` folder when OUT exists, or
renames it back to OUT when OUT is missing (the kill fell between the two renames). Anything it
cannot prove to be a dead run's is reported and left alone.

Resumable runs (quantize; quantkit.run.resume): a staging folder holding RESUME_NAME is an
interrupted run's finished work. A run stopped from outside (Ctrl-C, SIGTERM, out of memory, a full
disk, another process of a multi-process run dying) keeps it when it holds at least one finished block,
and says how to continue (`--resume`) or discard it; a run that fails on its own (bad input, NaN, a
bug) deletes it as before, since the same settings would fail the same way. SIGKILL and power loss keep it by nature. A dead run's resumable
folder is never deleted by a later run: without --resume the later run stops with an error naming
it; with --resume it is adopted (renamed to the new run's `.OUT.tmp-PID`). OUT itself is untouched
either way until the final rename.
"""
import errno
import json
import os
import shutil
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from tqdm.auto import tqdm

from quantkit.calibration.distributed import under_torchrun
from quantkit.checkpoint.files import REPORT_NAME
from quantkit.core.errors import QuantkitError, StoppedFromOutside
from quantkit.core.textfile import check_path_name

STAGING_MARKER = ".quantkit-staging.json"
RESUME_NAME = ".quantkit-resume.json"  # a resumable run's fingerprint (quantkit.run.resume)


def foreign_entries(folder: Path) -> list[str]:
    """Names in `folder` that quantkit did not write there (all of them when it has no file list)."""
    entries = sorted(p.name for p in folder.iterdir())
    try:
        listed = set(json.loads((folder / REPORT_NAME).read_text()).get("files", []))
    except (OSError, ValueError, AttributeError):
        listed = set()
    ours = listed | {REPORT_NAME, STAGING_MARKER} if listed else set()
    return [n for n in entries if n not in ours or not (folder / n).is_file() or (folder / n).is_symlink()]


def file_list(staging: Path) -> list[str]:
    """What goes in the report's `files`: every file written so far plus the report itself."""
    return sorted({p.name for p in staging.iterdir()} - {STAGING_MARKER, RESUME_NAME} | {REPORT_NAME})


def _contains(parent: Path, child: Path) -> bool:
    return parent == child or parent in child.parents


def _relation(out: Path, src: Path):
    if out == src:
        return "is"
    return "contains" if _contains(out, src) else "lies inside" if _contains(src, out) else None


def _local_folders(sources) -> list[Path]:
    paths = [Path(s).expanduser() for s in sources if s is not None]
    return [Path(os.path.realpath(p)) for p in paths if p.exists()]


def claim_output(out, overwrite: bool, sources=(), resume: bool = False) -> Path:
    """check_output at the start of a run, after dealing with the staging folders that dead runs left
    next to OUT (recover_stale): one of them may be the user's previous checkpoint, to be put back
    before OUT is judged. An interrupted resumable run of OUT is an error unless `resume`."""
    recover_stale(_place(out, sources), resume)
    return check_output(out, overwrite, sources)


def check_output(out, overwrite: bool, sources=()) -> Path:
    """OUT as an absolute path (symlinks in its parents resolved), or a QuantkitError saying why not."""
    path = _place(out, sources)
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise QuantkitError(f"output folder {out} already exists: choose another -o or pass --overwrite")
        foreign = foreign_entries(path)
        if foreign:
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            raise QuantkitError(f"output folder {out} holds files that quantkit did not write ({shown}); --overwrite "
                                "only replaces a checkpoint written by quantkit: choose another -o, or move them away")
    return path


STAGING_EXTRA = len(".") + len(".tmp-") + 10  # what the staging folder's name .NAME.tmp-PID adds to NAME


def _place(out, sources) -> Path:
    """OUT resolved, if it may be written at all: not a file or a link, not the source's or the cwd's folder."""
    given = Path(out).expanduser()
    if str(out).strip() == "":
        raise QuantkitError("the output folder is empty: pass -o with a folder name")
    check_path_name(given, "-o", reserve=STAGING_EXTRA)  # at the start, never after the run
    if given.is_symlink():
        raise QuantkitError(f"-o {out} is a symbolic link: pass the real folder path (quantkit never replaces a link)")
    path = Path(os.path.realpath(given))
    if path.exists() and not path.is_dir():
        raise QuantkitError(f"-o {out} is a file, not a folder: choose a folder path for the checkpoint")
    for src in _local_folders(sources):
        relation = _relation(path, src)
        if relation:
            raise QuantkitError(f"-o {out} {relation} the source model folder {src}: "
                                "write the checkpoint to a separate folder")
    if _contains(path, Path.cwd().resolve()):
        raise QuantkitError(f"-o {out} is the current directory or one of its parents: "
                            "write the checkpoint to a new folder, e.g. -o ./quantized")
    return path


# --------------------------------------------------------------------------- staging


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _staging_owner(folder: Path):
    """(host, pid) from a staging marker, or None when the folder carries none."""
    try:
        marker = json.loads((folder / STAGING_MARKER).read_text())
        return str(marker["host"]), int(marker["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _dead_run_of_this_host(folder: Path, pid_text: str) -> bool:
    """True only when provably left by a quantkit run of this host that no longer exists."""
    if not pid_text.isdigit():
        return False
    owner = _staging_owner(folder)
    if owner is None or owner != (socket.gethostname(), int(pid_text)):
        return False
    return owner[1] == os.getpid() or not _pid_alive(owner[1])  # our own pid: a previous holder's


def _live_run_of_this_host(folder: Path) -> bool:
    """A staging folder whose marker names a running process of this host other than this one."""
    owner = _staging_owner(folder)
    return (owner is not None and owner[0] == socket.gethostname() and owner[1] != os.getpid()
            and _pid_alive(owner[1]))


def _say(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def recover_stale(out: Path, resume: bool = False) -> None:
    """Clean up (or report) the staging folders that interrupted runs left next to OUT; a dead run's
    resumable folder is kept, and is an error unless `resume` (the caller adopts it: partial_runs)."""
    if not out.parent.is_dir():
        return
    partial = partial_runs(out)
    for kind in ("tmp", "old"):
        for stale in sorted(out.parent.glob(f".{out.name}.{kind}-*")):
            pid_text = stale.name.rsplit("-", 1)[1]
            if stale in partial:
                continue
            if kind == "tmp" and _live_run_of_this_host(stale):
                raise QuantkitError(f"another quantkit run (pid {pid_text}) is writing {out} right now (into "
                                    f"{stale}): let it finish or choose another -o (if no quantkit run is writing "
                                    "it, that process only reuses the pid: delete the folder)")
            if not _dead_run_of_this_host(stale, pid_text):
                _say(f"note: {stale} was left by another or a still-running quantkit process "
                     "(or is not quantkit's): it is left alone; delete it yourself if it is not in use")
            elif kind == "old" and not out.exists():
                stale.rename(out)
                (out / STAGING_MARKER).unlink(missing_ok=True)
                _say(f"note: restored {out} from {stale.name}, left by an interrupted --overwrite run")
            else:
                shutil.rmtree(stale)
                _say(f"note: removed {stale.name}, left by an interrupted quantkit run (pid {pid_text})")
    if partial and not resume:
        raise QuantkitError(f"an interrupted quantize run of {out} left its finished blocks in {partial[0]}: run the "
                            "same quantize command with --resume to continue it, or delete that folder to start over")
    if len(partial) > 1:
        names = ", ".join(p.name for p in partial)
        raise QuantkitError(f"{len(partial)} interrupted quantize runs of {out} can be resumed ({names}): delete "
                            "all but the one to continue")


def partial_runs(out: Path) -> list[Path]:
    """The staging folders of OUT that dead quantkit runs of this host left with resumable work in them."""
    found = []
    for stale in sorted(out.parent.glob(f".{out.name}.tmp-*")):
        if (stale / RESUME_NAME).is_file() and _dead_run_of_this_host(stale, stale.name.rsplit("-", 1)[1]):
            found.append(stale)
    return found


def _mark(folder: Path) -> None:
    (folder / STAGING_MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))


def _normal_permissions(folder: Path) -> None:
    """Some writers (safetensors) create files 0600; give every file the mode the umask implies."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


@contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (kill, timeouts) runs the same cleanup as Ctrl-C, instead of dying mid-write."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write_error(out: Path, e: OSError) -> QuantkitError:
    if e.errno == errno.ENOSPC:
        hint = "no space left on the device: free some space or write to another disk with -o"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "no permission to write there: choose another -o"
    else:
        hint = "check the path and the disk, then run again"
    return QuantkitError(f"could not write {out} ({e.strerror or e}); nothing was written: {hint}")


@contextmanager
def staged_folder(out, overwrite: bool, sources=(), adopt: Path | None = None, keep=None):
    """Yields an empty staging folder (or `adopt`, a dead run's resumable one, renamed to this run's); on
    success its files replace OUT, on a failure it is deleted.

    keep(staging) -> str | None: for a resumable run, what the staging holds that is worth keeping ("7 of 30
    blocks"); when it says something, an interruption (Ctrl-C, SIGTERM), running out of memory or a full disk
    keeps the folder and tells the user how to continue it. The caller writes files (no sub-folders) into it and
    lists them in quantkit_report.json's `files`: that list is what lets a later --overwrite recognise the folder
    as quantkit's.
    """
    out = check_output(out, overwrite, sources)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]  # removed again on failure
    staging = None  # set once this run has made tmp: never delete a folder someone else made
    try:
        with _sigterm_as_interrupt():
            out.parent.mkdir(parents=True, exist_ok=True)
            if adopt is not None:
                adopt.rename(tmp)
            else:
                tmp.mkdir()
            staging = tmp
            _mark(tmp)
            yield tmp
            (tmp / STAGING_MARKER).unlink()
            _normal_permissions(tmp)
            check_output(out, overwrite, sources)  # the world may have changed during a long run
            _replace(out, tmp)
    except OSError as e:
        kept = _keep(staging, keep) if e.errno in (errno.ENOSPC, errno.EDQUOT) else None
        if kept is None:
            _discard(staging, created)
            raise _write_error(out, e) from e
        raise QuantkitError(f"could not write {out} ({e.strerror or e}): no space left on the device; {kept}: "
                            f"free some space and {_resume_hint()}, or delete that folder") from e
    except BaseException as e:
        # an adopted folder holds an earlier run's work: whatever fails now, it is kept (resume never destroys work)
        kept = _keep(staging, keep) if _from_outside(e) or adopt is not None else None
        if kept is None:
            _discard(staging, created)
        elif not _from_outside(e):
            _say(f"{kept}; once the error below is fixed, {_resume_hint()} to continue, or delete that folder")
        else:
            what = ("interrupted" if isinstance(e, KeyboardInterrupt) else "stopped" if isinstance(e, StoppedFromOutside)
                    else "out of memory")
            _say(f"{what}: {kept}; {_resume_hint()} to continue, or delete that folder")
        raise


def _resume_hint() -> str:
    """A run over several processes resumes as one (the blocks it wrote are the same either way)."""
    if under_torchrun():
        return "run the same command as one process (without --processes or torchrun) with --resume"
    return "run the same command with --resume"


def _from_outside(e: BaseException) -> bool:
    """A failure that another try can get past: Ctrl-C/SIGTERM, memory (CPU, or torch's CUDA OOM), or another
    process of the run dying."""
    return isinstance(e, (KeyboardInterrupt, MemoryError, StoppedFromOutside)) or type(e).__name__ == "OutOfMemoryError"


def _keep(staging, keep) -> str | None:
    """'the N of M blocks finished are kept in PATH' when the staging holds resumable work, else None."""
    if staging is None or keep is None:
        return None
    try:
        what = keep(staging)
    except Exception:  # deciding must never hide the original error
        return None
    return f"the {what} finished are kept in {staging}" if what else None


def _discard(staging, created: list[Path]) -> None:
    """Delete the staging folder and the parents this run created; never anything that was there before."""
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    for folder in created:  # innermost first; only if still empty
        try:
            folder.rmdir()
        except OSError:
            break


def _replace(out: Path, tmp: Path) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    _mark(out)  # so that a run killed between the renames can be recovered by the next one
    try:
        out.rename(old)
    except OSError:
        (out / STAGING_MARKER).unlink(missing_ok=True)
        raise
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)
        (out / STAGING_MARKER).unlink(missing_ok=True)
        raise
    shutil.rmtree(old, ignore_errors=True)

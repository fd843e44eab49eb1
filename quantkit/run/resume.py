"""--resume: what an interrupted quantize run keeps, and when another run may continue it.

A streamed run's staging folder (`.OUT.tmp-PID`, quantkit.run.output) holds, besides the staging marker:
  .quantkit-resume.json          the run's fingerprint (below), written when the folder is made
  part-block-NNNNN.safetensors   one per finished decoder block (quantkit.checkpoint.shards.save_part: renamed
                                 into place whole, so a part that exists is complete), in block order
  part-top-NNNNN.safetensors     the tensors outside the blocks, written after the last block
A run stopped from outside (Ctrl-C, SIGTERM, SIGKILL, power loss, a full disk) leaves that folder behind;
`quantize ... --resume` adopts it, checks the fingerprint, keeps blocks 0..k-1 and continues at block k.
Calibrated methods replay blocks 0..k-1 from their parts to rebuild block k's inputs: the part's packed
layers decode bit for bit to the weights the interrupted run computed with (codes, fp16 scales and integer
zeros round-trip unchanged), and every other tensor whose in-loop value its stored dtype could not hold
(fp32 compute on CPU, AWQ-scaled norms) has an exact copy under shards.RESUME_PREFIX. So the resumed run
produces the same checkpoint, byte for byte, as one that was never interrupted (on the same device and
versions, which the fingerprint pins).

The fingerprint is everything the finished blocks depend on: the settings (QuantConfig), device, dtype,
quantkit and torch versions, the number of blocks, the source model (its config.json's SHA-256 and every
file's size and modification time; a hub id by name) and the calibration token ids (SHA-256). Any
difference refuses the resume, naming what changed. Once the shards are assembled the fingerprint is
deleted first, then the parts: from then on (the last seconds of a run) the folder is an ordinary dead
staging folder that the next run removes.
"""
import hashlib
import json
import sys
from pathlib import Path

import torch

from quantkit.checkpoint import shards
from quantkit.core.errors import QuantkitError
from quantkit.core.version import __version__
from quantkit.run.output import RESUME_NAME

VERSION = 1


def block_key(i: int) -> str:
    return f"block-{i:05d}"


def fingerprint(model: str, config, device: str, dtype: str, n_blocks: int, calibration_ids=None,
                target=None) -> dict:
    """What the finished blocks of a run depend on, as JSON (see the module docstring). target: the --target-bits or
    --target-size (QuantConfig.target) whose allocation config's overrides hold (cleared once it is allocated)."""
    calibration = None
    if calibration_ids is not None:
        ids = calibration_ids.detach().to(torch.int64).cpu().contiguous()
        calibration = hashlib.sha256(str(list(ids.shape)).encode() + ids.numpy().tobytes()).hexdigest()
    settings = config.to_dict()
    if Path(settings["dataset"]).expanduser().is_file():  # one file, however it was named (relative, ~, absolute)
        settings["dataset"] = str(Path(settings["dataset"]).expanduser().resolve())
    fp = {"version": VERSION, "quantkit": __version__, "torch": torch.__version__, "settings": settings,
          "device": device, "dtype": dtype, "blocks": n_blocks, "source": source_state(model),
          "calibration": calibration}
    if target is not None:
        fp["target"] = target
    return json.loads(json.dumps(fp, default=str))  # as it reads back from the file


def allocated_config(folder: Path, config):
    """`config` (a --target-bits / --target-size run's) with the allocation the interrupted run in `folder` made and
    recorded in its
    fingerprint, when it was made for the same target; else `config` as given (then it is measured again, and a
    different result is refused by check)."""
    try:
        old = json.loads((folder / RESUME_NAME).read_text())
    except (OSError, ValueError):
        return config
    settings = old.get("settings") or {}
    if old.get("target") != config.target or settings.get("target_bits") is not None \
            or settings.get("target_size") is not None:
        return config
    return config.without_target(settings.get("modules") or [])


def source_state(model: str) -> dict:
    """A local folder: its config.json's SHA-256 and each file's [size, mtime_ns]; a hub id: its name."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return {"hub id": str(model)}
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file():
            st = p.stat()
            files[p.name] = [st.st_size, st.st_mtime_ns]
    config = folder / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    return {"config.json sha256": digest, "files": files}


def write(folder: Path, fp: dict) -> None:
    (folder / RESUME_NAME).write_text(json.dumps(fp, indent=1))


def check(folder: Path, fp: dict) -> None:
    """A QuantkitError naming what differs between the interrupted run in `folder` and this one."""
    try:
        old = json.loads((folder / RESUME_NAME).read_text())
    except (OSError, ValueError) as e:
        raise QuantkitError(f"cannot resume the interrupted run in {folder}: its {RESUME_NAME} is unreadable ({e}); "
                            "delete that folder to start over") from e
    changes = differences(old, fp)
    if changes:
        shown = "; ".join(changes[:4]) + ("; ..." if len(changes) > 4 else "")
        raise QuantkitError(f"cannot resume the interrupted run in {folder}: {shown}. Its finished blocks only fit "
                            "the original run: resume with the original settings and source, or delete that folder "
                            "to start over")


def differences(old: dict, new: dict) -> list[str]:
    out = []
    for key in ("version", "quantkit", "torch"):
        if old.get(key) != new.get(key):
            out.append(f"{key} version {old.get(key)} -> {new.get(key)}")
    settings_old, settings_new = old.get("settings") or {}, new.get("settings") or {}
    for key in sorted(set(settings_old) | set(settings_new)):
        if settings_old.get(key) != settings_new.get(key):
            out.append(f"--{key.replace('_', '-')} {settings_old.get(key)!r} -> {settings_new.get(key)!r}")
    for key in ("device", "dtype", "blocks"):
        if old.get(key) != new.get(key):
            out.append(f"{key} {old.get(key)!r} -> {new.get(key)!r}")
    src_old, src_new = old.get("source") or {}, new.get("source") or {}
    if src_old.get("hub id") != src_new.get("hub id"):
        was, now = (s.get("hub id") or "a local folder" for s in (src_old, src_new))
        out.append(f"source model {was} -> {now}")
    elif src_old.get("config.json sha256") != src_new.get("config.json sha256"):
        out.append("the source model's config.json changed")
    files_old, files_new = src_old.get("files") or {}, src_new.get("files") or {}
    for name in sorted(set(files_old) | set(files_new)):
        if name not in files_new:
            out.append(f"the source file {name} is gone")
        elif name not in files_old:
            out.append(f"the source has a new file {name}")
        elif files_old[name] != files_new[name]:
            out.append(f"the source file {name} changed (size or modification time)")
    if old.get("calibration") != new.get("calibration"):
        out.append("the calibration token ids changed (dataset, tokenizer or sampling)")
    return out


DAMAGED_PREFIX = "damaged-"


def set_aside_damaged(folder: Path) -> None:
    """Rename each damaged part file (shards.damaged_part) to damaged-NAME and say so: its block is quantized again,
    every whole part is kept. The set-aside files go when the run finishes."""
    for key in shards.part_keys(folder):
        path = folder / shards.part_name(key)
        why = shards.damaged_part(path)
        if why:
            aside = path.with_name(DAMAGED_PREFIX + path.name)
            path.rename(aside)
            print(f"warning: {path.name} in {folder} is damaged ({why}): set aside as {aside.name}; what it held is "
                  "made again", file=sys.stderr)


def finished_blocks(folder: Path) -> int:
    """How many blocks, from block 0 on, have their part in `folder`."""
    done = set(shards.part_keys(folder))
    k = 0
    while block_key(k) in done:
        k += 1
    return k


def progress(folder: Path, n_blocks: int) -> str | None:
    """'7 of 30 blocks' when `folder` holds a resumable run with at least one finished block, else None."""
    if not (folder / RESUME_NAME).is_file():
        return None
    k = finished_blocks(folder)
    return f"{k} of {n_blocks} blocks" if k else None


def finish(folder: Path) -> None:
    """The shards are assembled: the run can no longer be resumed (fingerprint first, then the parts)."""
    (folder / RESUME_NAME).unlink(missing_ok=True)
    shards.delete_parts(folder)
    for damaged in folder.glob(f"{DAMAGED_PREFIX}*"):
        damaged.unlink()


def clean(folder: Path) -> None:
    """What a kill can leave half-made in an adopted folder: part files not yet renamed into place."""
    for p in folder.glob(f"{shards.PART_PREFIX}*.partial"):
        p.unlink()

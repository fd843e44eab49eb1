"""Writing and reading quantized checkpoint folders (safetensors shards + config), atomically.

Folder layout (readable by GPTQ-aware tools):
  config.json                 the model config + "quantization_config" (see quantization_config())
  quantize_config.json        the same quantization_config alone (AutoGPTQ/GPTQModel convention)
  model.safetensors           or model-0000i-of-0000N.safetensors + model.safetensors.index.json
                              metadata {"format": "pt"}; quantized linears as GPTQ-layout tensors
  tokenizer files, generation_config.json
  quantkit_recipe.yaml        the effective options, to repeat the run (quantkit quantize --recipe)
  quantkit_report.json        per-layer method, bits, error, damping, time (quantkit inspect shows it)
Everything is written into a hidden temporary sibling folder and renamed into place at the end, so a
failed or interrupted run never leaves a half checkpoint at OUT.
"""
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quantkit.errors import QuantkitError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text) -> int:
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", str(text))
    unit = (m.group(2) or "B").upper() if m else None
    if not m or unit not in UNITS:
        raise QuantkitError(f"shard size '{text}' is not understood: use a size like 500MB or 4GB")
    return int(float(m.group(1)) * UNITS[unit])


def refuse_existing(out: Path, overwrite: bool) -> None:
    if Path(out).exists() and not overwrite:
        raise QuantkitError(f"output folder {out} already exists: choose another -o or pass --overwrite")


@contextmanager
def atomic_folder(out: Path, overwrite: bool):
    """Yields a temporary folder; on success it replaces `out`, on failure it is deleted."""
    out = Path(out)
    refuse_existing(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def drop_shared(tensors: dict) -> dict:
    """Keep one name per storage (tied embeddings): safetensors refuses shared tensors."""
    seen, kept = set(), {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.device.type != "meta" else name
        if key in seen:
            continue
        seen.add(key)
        kept[name] = t
    return kept


def write_tensors(folder: Path, tensors: dict, max_shard_bytes: int) -> None:
    """safetensors shards of at most max_shard_bytes (a single tensor may exceed it), with an index."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], folder / SINGLE_NAME, metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def read_config(folder) -> dict:
    """config.json of a quantized folder, checked: clear errors for the common mistakes."""
    folder = Path(folder)
    if not folder.is_dir():
        raise QuantkitError(f"quantized model folder {folder} not found: pass the -o folder of `quantkit quantize`")
    path = folder / "config.json"
    if not path.is_file():
        raise QuantkitError(f"{folder} has no config.json: pass a folder written by `quantkit quantize`")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise QuantkitError(f"{path} is not valid JSON ({e}): the checkpoint is damaged, quantize again") from e
    qc = config.get("quantization_config")
    if not qc:
        raise QuantkitError(f"{folder} has no quantization_config in config.json: it is not a quantized checkpoint "
                            "(evaluate it as a floating-point model, or quantize it first with `quantkit quantize`)")
    if qc.get("quant_method") != "gptq":
        raise QuantkitError(f"{folder} uses quant_method '{qc.get('quant_method')}', which this version cannot load: "
                            "only GPTQ-layout checkpoints (rtn, gptq, awq, awq+gptq) are supported")
    return config


def shard_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise QuantkitError(f"{index} is damaged ({e}): quantize the model again") from e
        files = [folder / n for n in names]
    else:
        files = [folder / SINGLE_NAME]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise QuantkitError(f"{folder} is missing {', '.join(missing)}: the checkpoint is incomplete, quantize again")
    return files


def read_tensors(folder) -> dict:
    """Every tensor of the checkpoint on CPU; a truncated or corrupted file is a clear error."""
    folder = Path(folder)
    tensors = {}
    for f in shard_files(folder):
        try:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    tensors[name] = sf.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise QuantkitError(f"{f} is truncated or corrupted ({e}): copy it again or quantize again") from e
    return tensors

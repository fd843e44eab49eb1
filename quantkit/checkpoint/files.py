"""Writing and reading quantized checkpoint folders (safetensors shards + config), atomically.

Folder layout (readable by GPTQ-aware tools; an AutoGPTQ folder whose quantize_config.json is its only
quantization config, and whose one shard may be named after model_file_base_name, is read too):
  config.json                 the model config + "quantization_config" (see quantization_config())
  quantize_config.json        the same quantization_config alone, GPTQ layout only (the AutoGPTQ/GPTQModel
                              convention: Codec.writes_quantize_config)
  model.safetensors           or model-0000i-of-0000N.safetensors + model.safetensors.index.json
                              metadata {"format": "pt"}; quantized linears as their codec's tensors
                              (quantkit.checkpoint.codecs: the GPTQ layout by default)
  tokenizer files, generation_config.json
  quantkit_recipe.yaml        the effective options, to repeat the run (quantkit quantize --recipe)
  quantkit_report.json        per-layer method, bits, error, damping, time (quantkit inspect shows it)
Which files a folder gets, for quantize and convert alike: quantkit.run.folder. Where the folder may be written
and how it is staged and renamed into place: quantkit.run.output.
"""
import json
import os
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quantkit.checkpoint import codecs, shards
from quantkit.core.errors import QuantkitError
from quantkit.core.folders import INDEX_NAME, SINGLE_NAME, index_map

REPORT_NAME = "quantkit_report.json"
QUANTIZE_CONFIG = "quantize_config.json"
RECIPE_NAME = "quantkit_recipe.yaml"
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text, what: str = "shard size") -> int:
    """Bytes of a size (`what` names it in errors): an int, or a number with a unit (500MB, 4GB, 2GiB)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", str(text))
        unit = (m.group(2) or "B").upper() if m else None
        if not m or unit not in UNITS:
            raise QuantkitError(f"{what} '{text}' is not understood: use a size like 500MB or 4GB")
        size = int(float(m.group(1)) * UNITS[unit])
    if size < 1:
        raise QuantkitError(f"{what} '{text}' is not a positive size: use a size like 500MB or 4GB")
    return size


def write_tensors(folder: Path, tensors: dict, max_shard_bytes: int) -> None:
    """safetensors shards of at most max_shard_bytes (a single tensor may exceed it), with an index: cut and named
    as a streamed run's (quantkit.checkpoint.shards.plan), tensors in the dict's order."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}

    def nbytes(name):
        return tensors[name].numel() * tensors[name].element_size()

    planned = shards.plan(list(tensors), nbytes, max_shard_bytes)
    for fname, shard in zip(shards.shard_names(len(planned)), planned):
        _save({name: tensors[name] for name in shard}, folder / fname)
    shards.write_index(folder, planned, nbytes)


def _save(tensors: dict, path: Path) -> None:
    """save_file, with its I/O failures (e.g. disk full) raised as the OSError they are."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as e:
        save_error(e, path)


def save_error(e, path: Path):
    """Raise a SafetensorError that reports an I/O failure as the OSError it is (ENOSPC says disk full)."""
    code = re.search(r"os error (\d+)", str(e))
    if code is None:
        raise e
    raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# the report fields other commands read (inspect, eval compare, convert), and their JSON types ("layers": quantize's
# per-layer figures, or convert's count of the layers it repacked)
REPORT_FIELDS = {"model": str, "layers": (dict, int), "flagged": list, "coverage": dict, "experts": dict,
                 "files": list, "carried": list}
LAYER_NUMBERS = ("error", "cosine", "sqnr_db")


def read_report(folder) -> dict:
    """The quantkit report a checkpoint folder holds (quantize's or convert's); {} when it has none. The fields other
    commands read are checked: a damaged report is one error line, not a traceback far from it."""
    path = Path(folder) / REPORT_NAME
    if not path.is_file():
        return {}
    report = read_json(path)
    fix = "restore it, or delete it (the checkpoint loads without it)"
    for key, kind in REPORT_FIELDS.items():
        if key in report and not isinstance(report[key], kind):
            want = {str: "a string", dict: "an object", list: "a list", (dict, int): "an object or a count"}[kind]
            raise QuantkitError(f"{path} is damaged: '{key}' should be {want}, not {json.dumps(report[key])[:40]}; "
                                f"{fix}")
    layers = report["layers"] if isinstance(report.get("layers"), dict) else {}
    for name, layer in layers.items():
        if not (isinstance(layer, dict) and all(_number_or_none(layer.get(k)) for k in LAYER_NUMBERS)
                and isinstance(layer.get("method", ""), str)):
            raise QuantkitError(f"{path} is damaged: the entry of layer {name} is not an object of numbers; {fix}")
    return report


def _number_or_none(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuantkitError(f"{path} is not valid JSON ({e}): the file is damaged; restore it or quantize again") from e
    if not isinstance(data, dict):
        raise QuantkitError(f"{path} must hold a JSON object: the file is damaged; restore it or quantize again")
    return data


def read_config(folder) -> dict:
    """config.json of a quantized folder, its quantization_config checked field by field."""
    folder = Path(folder)
    if folder.is_file():
        raise QuantkitError(f"{folder} is a file, not a quantized model folder: pass the folder that holds it (the -o "
                            "folder of `quantkit quantize`)")
    if not folder.is_dir():
        raise QuantkitError(f"quantized model folder {folder} not found: pass the -o folder of `quantkit quantize`")
    path = folder / "config.json"
    if not path.is_file():
        raise QuantkitError(f"{folder} has no config.json: pass a folder written by `quantkit quantize`")
    config = read_json(path)
    qc = config.get("quantization_config") or _autogptq_config(folder)
    if not qc:
        raise QuantkitError(f"{folder} has no quantization_config in config.json and no {QUANTIZE_CONFIG}: it is not "
                            "a quantized checkpoint (evaluate it as a floating-point model, or quantize it first with "
                            "`quantkit quantize`)")
    config["quantization_config"] = qc
    if not isinstance(qc, dict):
        raise QuantkitError(f"{path} quantization_config must be a JSON object: the checkpoint is damaged")
    codec = codecs.codec_named(qc, str(path))
    codec.check_config(qc, str(path))
    codec.check_folder(folder, qc)
    return config


def _autogptq_config(folder: Path):
    """quantize_config.json of a folder whose config.json has no quantization_config (AutoGPTQ's layout);
    AutoGPTQ before 0.7 wrote no quant_method, and every such file describes GPTQ tensors."""
    path = folder / QUANTIZE_CONFIG
    if not path.is_file():
        return None
    qc = read_json(path)
    return {"quant_method": "gptq", **qc}


def has_quantization_config(folder) -> bool:
    """Whether a folder declares itself quantized (config.json's quantization_config or quantize_config.json)."""
    folder = Path(folder)
    cfg = folder / "config.json"
    return cfg.is_file() and ("quantization_config" in read_json(cfg) or (folder / QUANTIZE_CONFIG).is_file())


def read_checkpoint(folder):
    """(config, tensors, layers, codec) of a quantized folder, validated as a whole before any model is built."""
    return read_checkpoint_as_stored(folder)[:4]


def read_checkpoint_as_stored(folder):
    """read_checkpoint's four, and the names of the tensors that are the files' own: those the codec's check did not
    rewrite (a foreign layout's tensors are repacked to quantkit's, some under the same names)."""
    config = read_config(folder)
    qc = config["quantization_config"]
    codec = codecs.codec_named(qc, str(folder))
    if not codec.safetensors:
        raise QuantkitError(f"{folder} is a {codec.quant_method} checkpoint: load_quantized and `quantkit eval` read "
                            "it (dequantized); convert and inspect read safetensors checkpoints")
    carried = set(carried_tensors(folder))
    tensors = {n: t for n, t in read_tensors(folder).items() if n not in carried}
    as_read = dict(tensors)
    layers = codec.read_layers(qc, tensors, str(folder))
    return config, tensors, layers, codec, {n for n, t in tensors.items() if as_read.get(n) is t}


def carried_tensors(folder) -> list[str]:
    """The tensors a quantize run carried from its source unchanged, which the model does not load (MTP layers):
    the report lists them; a reader of the model leaves them alone."""
    return read_report(folder).get("carried", [])


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a quantized folder; a sharded one's index checked against them (index_map)."""
    fix = "the checkpoint is damaged, quantize again"
    others = sorted(folder.glob("*.safetensors"))
    if (folder / INDEX_NAME).is_file():
        files = [folder / n for n in sorted(set(index_map(folder, fix).values()))]
    elif not (folder / SINGLE_NAME).is_file() and len(others) == 1:
        files = others  # AutoGPTQ names its one shard after model_file_base_name (gptq_model-4bit-128g.safetensors)
    elif not (folder / SINGLE_NAME).is_file() and len(others) > 1:
        raise QuantkitError(f"{folder} has {len(others)} safetensors shards ({others[0].name}, ...) but no "
                            f"{INDEX_NAME}, which says which tensor is where: {fix}")
    else:
        files = [folder / SINGLE_NAME]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise QuantkitError(f"{folder} is missing {', '.join(missing)}: the checkpoint is incomplete, quantize again")
    return files


def tensor_files(folder) -> dict:
    """{tensor name: the safetensors file holding it} of a quantized folder (headers only)."""
    out = {}
    for f in shard_files(Path(folder)):
        try:
            with safe_open(f, framework="pt") as sf:
                out.update({name: f for name in sf.keys()})
        except (SafetensorError, OSError) as e:
            raise QuantkitError(f"{f} is truncated or corrupted ({e}): copy it again or quantize again") from e
    return out


def read_tensors(folder, names=None, files=None) -> dict:
    """The checkpoint's tensors (`names`, default all) on CPU, as memory-mapped views of the files (a page is
    resident while touched and its view alive); a truncated or corrupted file is a clear error. files: the
    tensor_files map, when the caller already has it."""
    files = files if files is not None else tensor_files(folder)
    by_file = {}
    for name in (files if names is None else names):
        by_file.setdefault(files[name], []).append(name)
    tensors = {}
    for f, group in by_file.items():
        try:
            with safe_open(f, framework="pt") as sf:
                for name in group:
                    tensors[name] = sf.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise QuantkitError(f"{f} is truncated or corrupted ({e}): copy it again or quantize again") from e
    return tensors

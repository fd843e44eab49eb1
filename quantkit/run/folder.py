"""The checkpoint folder writer of `quantkit quantize` and `quantkit convert`.

One place decides which files a quantized folder holds and how each is written, so the two commands cannot drift
apart: what one writes for a format, the other writes for it too (tests/test_convert.py checks that converting a
quantize output to its own format gives the same config files and shards). In write order:

  weights           the codec's files: safetensors shards of at most max_shard_bytes, plus
                    model.safetensors.index.json when there are several (cut by quantkit.checkpoint.shards.plan), or
                    the codec's own file (model.gguf). From the part files of a streamed run (quantize) or from
                    tensors in memory (convert).
  sidecars          tokenizer files, generation_config.json, ...: saved from the loaded source (quantize), or copied
                    from the source folder (convert: everything that is not its weights or a file written here)
  config.json       the model's config with its quantization_config (quantization_config() below builds it for both)
  quantize_config.json   the quantization_config alone, only when the codec says so (Codec.writes_quantize_config:
                    the GPTQ layout, which AutoGPTQ and GPTQModel read from that file). AutoAWQ, llm-compressor,
                    llama.cpp and quantkit's own format write none, and AutoGPTQ would take one for a GPTQ config
  quantkit_recipe.yaml   the settings that repeat the run (quantize only: convert quantizes nothing)
  quantkit_report.json   last: its `files` lists everything above, which a later --overwrite trusts

The caller writes into the staging folder of quantkit.run.output.staged_folder, never into OUT: a failure anywhere
here leaves OUT as it was and the staging folder deleted (or, for a resumable quantize run stopped from outside,
kept for --resume).
"""
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quantkit.checkpoint import files
from quantkit.core.folders import INDEX_NAME
from quantkit.core.version import __version__
from quantkit.run import output
from quantkit.run.config import write_recipe

# the files this module writes itself: a source's copies describe the source, not the folder being written
OWN_FILES = frozenset({"config.json", files.QUANTIZE_CONFIG, INDEX_NAME, files.RECIPE_NAME, files.REPORT_NAME})
# AutoAWQ's own copy of its quantization config: a source's would describe the source's layout, which is not ours
STALE_CONFIGS = frozenset({"quant_config.json"})
WEIGHT_SUFFIXES = (".safetensors", ".gguf")
# quantization_config fields that say how the codes were made: quantize states its settings, and convert carries the
# source's, which a lossless repack keeps true (quantization_extra)
MADE_WITH = ("true_sequential", "damp_percent", "meta")


@dataclass
class FolderSpec:
    """What a checkpoint folder is written from. codec, config, tokenizer and name are also what the codec's weight
    writers read (Codec.write_files' `written`)."""
    codec: type             # the codec of the checkpoint's layers (quantkit.checkpoint.codecs)
    config: dict            # config.json as written, its quantization_config included
    tokenizer: object       # the source's tokenizer (a GGUF file embeds it), or None
    name: str               # the model's name (GGUF's general.name)
    max_shard_bytes: int    # the largest safetensors shard (quantkit.checkpoint.files.parse_size)
    sidecars: Callable      # sidecars(folder): writes the tokenizer, generation config, ... (saved_ / copied_sidecars)
    recipe: object = None   # the QuantConfig that repeats the run (quantize), None for convert


def quantization_extra(lm_head: bool, made_with: dict) -> dict:
    """The fields every quantization_config quantkit writes has after its layout's own: how the codes were made
    (made_with's MADE_WITH keys, those it has), whether lm_head is quantized, and the writer (GPTQModel's
    `quantizer` key). The order is the one quantize has always written."""
    made = {k: made_with[k] for k in MADE_WITH if k in made_with}
    return {**{k: made[k] for k in ("true_sequential", "damp_percent") if k in made}, "lm_head": lm_head,
            "quantizer": [f"quantkit:{__version__}"], **({"meta": made["meta"]} if "meta" in made else {})}


def quantization_config(codec, base, results: dict, linears: list, act_order: bool, lm_head: bool, made_with: dict,
                        fused=None) -> dict:
    """config.json's quantization_config, for quantize and convert alike. base: .bits, .group_size, .sym and
    .checkpoint_format the config states (the others become per-module entries); results: {linear: QuantResult};
    linears: every linear the format may name, quantized or left in float, in the model's order (the order of the
    format's lists); fused: {serving name: member linears} (quantkit.models.arch.fused_groups)."""
    return codec.quantization_config(base, results, linears, act_order=act_order,
                                     extra=quantization_extra(lm_head, made_with), fused=fused)


def write_weights(folder: Path, spec: FolderSpec, order: list, rename=str, tensors: dict | None = None) -> None:
    """The checkpoint's weight files, tensors in `order`. tensors None: from the part files in `folder` (a streamed
    quantize run; rename gives the names in the files), else from `tensors` in memory, named as in the files
    (convert). Either way safetensors shards are cut by the same plan and size."""
    if tensors is None:
        spec.codec.write_files(folder, order, spec.max_shard_bytes, rename, spec)
    elif spec.codec.safetensors:
        files.write_tensors(folder, {n: tensors[n] for n in order}, spec.max_shard_bytes)
    else:
        spec.codec.write_tensors(folder, {n: tensors[n] for n in order}, spec)


def write_rest(folder: Path, spec: FolderSpec, report: dict) -> None:
    """Everything but the weights, the report last (its `files` is what --overwrite recognises the folder by).
    The sidecars go first, so that no file of theirs can stand in for one of the configs."""
    spec.sidecars(folder)
    files.write_json(folder / "config.json", spec.config)
    if spec.codec.writes_quantize_config:
        files.write_json(folder / files.QUANTIZE_CONFIG, spec.config["quantization_config"])
    if spec.recipe is not None:
        write_recipe(spec.recipe, folder / files.RECIPE_NAME)
    report["files"] = output.file_list(folder)
    files.write_json(folder / files.REPORT_NAME, report)


def saved_sidecars(generation_config, tokenizer) -> Callable:
    """sidecars() of a quantize run: the source's generation config and tokenizer as transformers saves them (each
    may be None)."""
    def save(folder: Path) -> None:
        if generation_config is not None:
            generation_config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    return save


def copied_sidecars(source: Path) -> Callable:
    """sidecars() of a convert run: every file of the quantized folder `source` that is not its weights, a file
    write_rest writes, or AutoAWQ's quant_config.json (the tokenizer, generation config, chat template, README, ...),
    copied as it is: a folder quantize wrote gets back the files quantize saved."""
    def copy(folder: Path) -> None:
        for f in sorted(Path(source).iterdir()):
            if f.is_file() and is_sidecar(f.name):
                shutil.copy2(f, folder / f.name)
    return copy


def is_sidecar(name: str) -> bool:
    return name not in OWN_FILES and name not in STALE_CONFIGS and not name.endswith(WEIGHT_SUFFIXES)

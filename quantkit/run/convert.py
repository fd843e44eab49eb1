"""`quantkit convert`: repack a quantized folder into another integer layout, losslessly or not at all.

Every source layer is decoded exactly into its integer codes, fp16 scales and integer zeros (a QuantResult,
quantkit.checkpoint.repack) and re-encoded by the target codec; nothing is re-rounded, so the converted
checkpoint computes exactly what the source did. What the target cannot hold is refused by the codec with its
reason (AWQ: 4-bit, divisible groups; v1 "gptq": no zero of 0; any: no rotation, no codebook, no act-order
g_idx outside gptq). Linears the source leaves in floating point are carried over as such and declared in the
target's own way (GPTQ "-:" dynamic keys, AWQ modules_to_not_convert, compressed-tensors ignore).

The folder is written by quantkit.run.folder, quantize's writer, so a folder converted to the layout it already has
gets the config files quantize wrote (tests/test_convert.py): the quantization_config is built by the same call,
with the source's base settings and the fields saying how its codes were made (true_sequential, damp_percent,
meta), its linears in the order the source's report lists them (quantize's order) and the model family's fused
groups; the tensors keep the source's order (a sharded source's index order is quantize's), so the same shard
size cuts the same shards. Shards are at most `max_shard_size`: by default the size the source was quantized with
(its recipe's max_shard_size), else quantize's default, 4GB. Tensors the model does not load (MTP layers, the
report's `carried`) are carried over as quantize carries them.
"""
import json
import re
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

from quantkit.checkpoint import codecs
from quantkit.checkpoint import files as checkpoint
from quantkit.checkpoint import repack
from quantkit.core.errors import QuantkitError
from quantkit.core.folders import INDEX_NAME
from quantkit.core.version import __version__
from quantkit.models.arch import ARCHS, fused_groups
from quantkit.models.hub import load_tokenizer
from quantkit.run import folder as checkpoint_folder
from quantkit.run import output
from quantkit.run.config import QuantConfig, read_recipe

LAYER_LEAVES = (*repack.GPTQ_SUFFIXES, "bias")  # a quantized layer's tensors once read_layers has them


def source_results(tensors: dict, layers, codec, qc: dict, where: str) -> dict:
    """{name: QuantResult} of every quantized layer of a folder read by read_checkpoint."""
    zero_format = codec.int_zero_format(qc)
    results = {}
    for layer in layers:
        s = layer.settings
        if s.get("quantizer") != "int" or s.get("rotation") is not None:
            raise QuantkitError(f"{where}: {layer.name} is a {'rotated ' if s.get('rotation') else ''}"
                                f"{s.get('quantizer')} layer, which only the quantkit format holds: convert repacks "
                                "unrotated integer layers")
        if layer.scale_dtype != torch.float16:
            raise QuantkitError(f"{where}: {layer.name} has {str(layer.scale_dtype).removeprefix('torch.')} scales that "
                                "float16 cannot hold exactly, and the layouts convert writes store float16 scales: "
                                "load the folder as it is (load_quantized, eval), which keeps them")
        results[layer.name] = repack.result_of(tensors, layer, zero_format)
    return results


def float_linears(tensors: dict, results: dict) -> list[str]:
    """Linears left in float: a 2-D float `.weight` in a module beside a quantized linear (same parent), e.g. a
    down_proj a recipe skipped. Embeddings and lm_head sit elsewhere and stay out of the target's skip lists."""
    parents = {name.rpartition(".")[0] for name in results}
    return sorted(k[:-len(".weight")] for k, t in tensors.items()
                  if k.endswith(".weight") and t.dim() == 2 and t.is_floating_point()
                  and k[:-len(".weight")].rpartition(".")[0] in parents)


def model_order(names, report: dict) -> list[str]:
    """`names` in the model's order as far as the source says it: the layers of a quantize report in the order its run
    listed them (the order quantize's config lists them in), the others after them in natural order (layers.2
    before layers.10)."""
    listed = report.get("layers") if isinstance(report.get("layers"), dict) else {}
    rank = {name: i for i, name in enumerate(listed)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), _natural(n)))


def _natural(name: str) -> list:
    # re.split with a group alternates text and digit runs, so two keys compare str with str and int with int
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _fused(config: dict, linears) -> dict:
    """The fused groups quantize declares for this model (quantkit.models.arch.fused_groups): its family's, by
    config.json's model_type (a vision-language model's by its text_config's); none for a family found by shape."""
    types = [config.get("model_type"), (config.get("text_config") or {}).get("model_type")]
    arch = next((ARCHS[t] for t in types if t in ARCHS), None)
    return fused_groups(arch, linears) if arch is not None else {}


def _target_config(results: dict, fmt: str, qc: dict):
    """The base settings the target's config states: the source's when its config states bits, group_size and sym
    (GPTQ's), so a same-layout conversion keeps them; else the commonest. The others become per-module entries."""
    declared = tuple(qc.get(k) for k in ("bits", "group_size", "sym"))
    if None in declared:
        settings = Counter((r.quantizer.bits, r.group_size, r.quantizer.sym) for r in results.values())
        declared = settings.most_common(1)[0][0]
    bits, group_size, sym = declared
    return SimpleNamespace(bits=bits, group_size=group_size, sym=sym, checkpoint_format=fmt)


def shard_bytes(src: Path, max_shard_size) -> int:
    """max_shard_size, else the size the source was quantized with (its recipe's max_shard_size, what quantize's
    --max-shard-size was), else quantize's default. Not guessed from the source's shards: their sizes only bound it."""
    if max_shard_size is None:
        recipe = src / checkpoint.RECIPE_NAME
        try:
            max_shard_size = read_recipe(recipe).get("max_shard_size") if recipe.is_file() else None
        except QuantkitError:  # a recipe of another version: the default, like a folder without one
            max_shard_size = None
        max_shard_size = max_shard_size or QuantConfig.max_shard_size
    return checkpoint.parse_size(max_shard_size)


def _stored_order(src: Path) -> list[str]:
    """The source's tensor names, in its index's order when it has one (quantize writes it in the order it planned
    the shards in), else as its files list them."""
    if (src / INDEX_NAME).is_file():  # read_checkpoint has checked it against the shards
        return list(json.loads((src / INDEX_NAME).read_text())["weight_map"])
    return list(checkpoint.tensor_files(src))


def target_tensors(src: Path, tensors: dict, results: dict, target, base) -> dict:
    """{name in the files: tensor} of the converted checkpoint, in the source's order: each quantized layer's target
    tensors where its first tensor was, every other tensor as it is."""
    out, placed = {}, set()
    for name in [*_stored_order(src), *tensors]:
        module, _, leaf = name.rpartition(".")
        if module in results and (leaf in LAYER_LEAVES or name not in tensors):  # a foreign leaf read_layers replaced
            if module not in placed:
                placed.add(module)
                res = results[module]
                bias_dtype = res.bias.dtype if res.bias is not None else None
                out.update({f"{module}.{s}": t for s, t in target.layer_tensors(res, base, bias_dtype).items()})
        elif name in tensors:
            out.setdefault(name, tensors[name])
    return out


def _carried(src: Path, target, tensors: dict) -> list[str]:
    """The tensors the model does not load that the source carries (its report's `carried`), into `tensors` as
    stored, last (where quantize puts them); a GGUF file holds only what its architecture names, so it gets none,
    and the user is told."""
    names = checkpoint.carried_tensors(src)
    if not names:
        return []
    if not target.safetensors:
        print(f"warning: {src} carries {len(names)} tensors the model does not load ({names[0]}, ...): a "
              f"{target.quant_method} file has no place for them, they are left out", file=sys.stderr)
        return []
    tensors.update(checkpoint.read_tensors(src, names))
    return names


def convert(src, out, checkpoint_format: str, overwrite: bool = False, max_shard_size=None) -> dict:
    """Write the quantized folder `src` into `out` in `checkpoint_format`; returns the report. max_shard_size: the
    largest safetensors shard (an int or "500MB"; None: the source's, see shard_bytes)."""
    codecs.codec_of_format(checkpoint_format)  # an unknown name is refused before anything is read
    output.claim_output(out, overwrite, sources=[src])
    src = Path(src)
    max_bytes = shard_bytes(src, max_shard_size)
    config, tensors, layers, codec = checkpoint.read_checkpoint(src)
    qc = config["quantization_config"]
    results = source_results(tensors, layers, codec, qc, str(src))
    target = codecs.codec_for(results, checkpoint_format)
    base, made = _target_config(results, checkpoint_format, qc), checkpoint.read_report(src)
    linears = model_order([*results, *float_linears(tensors, results)], made)
    config["quantization_config"] = checkpoint_folder.quantization_config(
        target, base, results, linears, act_order=bool(qc.get("static_groups", False)),
        lm_head=any(n.rpartition(".")[2] == "lm_head" for n in results), made_with=qc, fused=_fused(config, linears))
    written = target_tensors(src, tensors, results, target, base)
    carried = _carried(src, target, written)
    made_from = made.get("model")  # a quantkit checkpoint's source carries over
    spec = checkpoint_folder.FolderSpec(target, config, load_tokenizer(src) if target.needs_tokenizer else None,
                                        Path(made_from).name if made_from else src.name, max_bytes,
                                        checkpoint_folder.copied_sidecars(src))
    target.check_source(config, spec.tokenizer, list(written))
    report = {"quantkit_version": __version__, **({"model": made_from} if made_from else {}),
              "converted_from": str(src), "source_quant_method": qc["quant_method"],
              "source_format": qc.get("checkpoint_format", qc["quant_method"]),  # gptq_v2 shows, not only "gptq"
              "checkpoint_format": checkpoint_format, "layers": len(results)}
    if carried:
        report["carried"] = carried
    with output.staged_folder(out, overwrite, sources=[src]) as tmp:
        checkpoint_folder.write_weights(tmp, spec, list(written), tensors=written)
        checkpoint_folder.write_rest(tmp, spec, report)
    return report

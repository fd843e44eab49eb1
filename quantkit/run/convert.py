"""`quantkit convert`: repack a quantized folder into another integer layout, losslessly or not at all.

Every source layer is decoded exactly into its integer codes, fp16 scales and integer zeros (a QuantResult,
quantkit.checkpoint.repack) and re-encoded by the target codec; nothing is re-rounded, so the converted
checkpoint computes exactly what the source did. What the target cannot hold is refused by the codec with its
reason (AWQ: 4-bit, divisible groups; v1 "gptq": no zero of 0; any: no rotation, no codebook, no act-order
g_idx outside gptq). Linears the source leaves in floating point are carried over as such and declared in the
target's own way (GPTQ "-:" dynamic keys, AWQ modules_to_not_convert, compressed-tensors ignore).
"""
import shutil
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
from quantkit.models.hub import load_tokenizer
from quantkit.run import output

SKIP_FILES = {"config.json", "quantize_config.json", INDEX_NAME, checkpoint.RECIPE_NAME, checkpoint.REPORT_NAME}


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


def _target_config(results: dict, fmt: str):
    """The base settings the target's config states (the commonest; the others become per-module entries)."""
    (bits, group_size, sym), _ = Counter((r.quantizer.bits, r.group_size, r.quantizer.sym)
                                         for r in results.values()).most_common(1)[0]
    return SimpleNamespace(bits=bits, group_size=group_size, sym=sym, checkpoint_format=fmt)


def convert(src, out, checkpoint_format: str, overwrite: bool = False) -> dict:
    """Write the quantized folder `src` into `out` in `checkpoint_format`; returns the report."""
    codecs.codec_of_format(checkpoint_format)  # an unknown name is refused before anything is read
    output.claim_output(out, overwrite, sources=[src])
    src = Path(src)
    config, tensors, layers, codec = checkpoint.read_checkpoint(src)
    qc = config["quantization_config"]
    results = source_results(tensors, layers, codec, qc, str(src))
    target = codecs.codec_for(results, checkpoint_format)
    all_linears = sorted([*results, *float_linears(tensors, results)])
    new_qc = target.quantization_config(_target_config(results, checkpoint_format), results, all_linears,
                                        act_order=bool(qc.get("static_groups", False)),
                                        extra={"quantizer": [f"quantkit:{__version__}"],
                                               "lm_head": any(n.rpartition(".")[2] == "lm_head" for n in results)})
    kept = {k: t for k, t in tensors.items()
            if k.rpartition(".")[0] not in results or k.rpartition(".")[2] not in (*repack.GPTQ_SUFFIXES, "bias")}
    for name, res in results.items():
        bias = res.bias
        for suffix, t in target.layer_tensors(res, _target_config(results, checkpoint_format),
                                              bias.dtype if bias is not None else None).items():
            kept[f"{name}.{suffix}"] = t
    config["quantization_config"] = new_qc
    tokenizer = load_tokenizer(src) if target.needs_tokenizer else None
    written = SimpleNamespace(config=config, tokenizer=tokenizer, name=src.name)
    target.check_source(config, written.tokenizer, list(kept))
    made_from = checkpoint.read_report(src).get("model")  # a quantkit checkpoint's source carries over
    report = {"quantkit_version": __version__, **({"model": made_from} if made_from else {}),
              "converted_from": str(src), "source_quant_method": qc["quant_method"],
              "source_format": qc.get("checkpoint_format", qc["quant_method"]),  # gptq_v2 shows, not only "gptq"
              "checkpoint_format": checkpoint_format, "layers": len(results)}
    with output.staged_folder(out, overwrite, sources=[src]) as tmp:
        if target.safetensors:
            checkpoint.write_tensors(tmp, kept, checkpoint.parse_size("4GB"))
        else:
            target.write_tensors(tmp, kept, written)
        checkpoint.write_json(tmp / "config.json", config)
        if target.writes_quantize_config:
            checkpoint.write_json(tmp / "quantize_config.json", new_qc)
        for f in src.iterdir():  # tokenizer, generation config: everything that is not weights or configs
            if f.is_file() and f.name not in SKIP_FILES and f.suffix not in (".safetensors", ".gguf"):
                shutil.copy2(f, tmp / f.name)
        report["files"] = output.file_list(tmp)
        checkpoint.write_json(tmp / checkpoint.REPORT_NAME, report)
    return report

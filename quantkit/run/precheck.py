"""What quantize refuses or warns about before any work: which linears it quantizes, each one's shape against its
quantizer, and the readers that would refuse the checkpoint (quantkit.checkpoint.compat)."""
import re
import sys

from quantkit.checkpoint import codecs, compat
from quantkit.core.errors import QuantkitError
from quantkit.core.groups import check_shape
from quantkit.gguf import mix as gguf_mix
from quantkit.gguf import types as gguf_types
from quantkit.models.arch import block_linears, fused_groups, get_submodule, get_weight, is_linear
from quantkit.models.moe import is_routed
from quantkit.models.names import FileNames
from quantkit.run.config import LayerSpec


def quantizable_linears(model, arch, head=None, traced=None) -> list[str]:
    """Full names of the linears inside the decoder blocks (those each block's forward multiplies as linear layers,
    given its traced uses: quantkit.calibration.capture.trace_blocks), then lm_head when `head`
    (quantkit.models.head.HeadPaths) is given (--lm-head); the embeddings are left alone."""
    blocks = get_submodule(model, arch.blocks)
    names = []
    for i, block in enumerate(blocks):
        for rel in block_linears(arch, block, traced[i] if traced else None):
            try:
                module = block.get_submodule(rel) if i else get_submodule(block, rel)
            except AttributeError:  # block 0 has it (the first block's own lookup names a wrong table)
                raise QuantkitError(f"{arch.blocks}.{i} has no {rel}, which block 0 has: this model's decoder blocks "
                                    f"differ from one another ({type(block).__name__}s of more than one shape, e.g. "
                                    "dense and mixture-of-experts layers as in DeepSeek), which this version cannot "
                                    "quantize yet") from None
            if not is_linear(module):
                raise QuantkitError(f"{arch.blocks}.{i}.{rel} is a {type(module).__name__}, not a linear layer")
            names.append(f"{arch.blocks}.{i}.{rel}")
    return names + ([head.lm_head] if head is not None else [])


def fused_expert_linears(model, arch, names) -> frozenset:
    """Which of `names` belong to experts the model holds fused, as 3-D tensors (transformers 5's layout), which
    quantkit splits into one linear each: the module that holds them is one of quantkit.models.moe's or sliced's."""
    blocks, prefix = get_submodule(model, arch.blocks), f"{arch.blocks}."
    out = set()
    for name in names:
        index, _, rel = name.removeprefix(prefix).partition(".")
        if name.startswith(prefix) and index.isdigit() and is_routed(blocks[int(index)], rel):
            out.add(name)
    return frozenset(out)


def kept_head(head, specs: dict):
    """The HeadPaths of --lm-head (quantkit.models.head), or None when none was asked for or a recipe skips lm_head."""
    return head if head is not None and specs[head.lm_head] is not None else None


def check_compat(config, arch, names, specs, shapes, fused_experts=frozenset(), renamed=()) -> list[str]:
    """Before any calibration (specs and shapes from layer_specs; fused_experts: fused_expert_linears): each layer's shape against
    its quantizer (an error), then the readers that would refuse the checkpoint (quantkit.checkpoint.compat; renamed:
    compat.renamed_floats, the float weights the model names otherwise):
    a QuantkitError for the --compat target, a warning line on stderr for each other reader."""
    _check_units(specs, shapes)
    codec = writer_codec(config, specs)
    codec.precheck(config, specs, shapes)
    problems = codec.compat_problems(config, specs, shapes, fused_groups(arch, names), fused_experts)
    problems += compat.transformers_renamed_floats(list(renamed))  # the loader's, whatever the layout
    found = compat.enforce(problems, config.compat)
    for line in found:
        print(f"warning: {line}", file=sys.stderr)
    return found


def writer_codec(config, specs: dict):
    """The codec that will write the run's layers (specs from layer_specs), known before any is quantized."""
    quantizers = {s.quantizer().name for s in specs.values() if s is not None}
    return codecs.codec_for_settings(config.checkpoint_format, quantizers, config.rotate != "none")


def file_aliases(in_files: FileNames, names) -> dict:
    """{name: (its name in the checkpoint's files,)}: what the report calls a linear, which recipe patterns match
    as well as the model's own name (Mixtral's block_sparse_moe.experts.0.w1 is the model's mlp.experts.0.gate_proj)."""
    return {n: (in_files.of_module(n),) for n in names}


def layer_specs(model, names, config, siblings=None, in_files=None) -> tuple[dict, dict]:
    """({name: its LayerSpec, None when skipped}, {name: (in_features, out_features)}): what the pre-checks and the
    method read. siblings: {name: the other linears of its fused group} (quantkit.models.arch.fused_siblings);
    in_files: the model's FileNames (built here when not given), whose names recipe patterns match too."""
    siblings, aliases = siblings or {}, file_aliases(in_files or FileNames(model), names)
    specs = {n: config.spec_for(n, siblings.get(n, ()), aliases.get(n, ())) for n in names}
    shapes = {n: tuple(reversed(get_weight(model.get_submodule(n)).shape)) for n in names}
    if getattr(config, "gguf_type", None) and not (config.gguf_type == "auto" and config.target is not None):
        specs = _gguf_specs(config.gguf_type, specs, shapes, model.config.to_dict(), config.needs_calibration)
    return specs, shapes


def _gguf_specs(file_type: str, specs: dict, shapes: dict, model_config: dict, calibrated: bool) -> dict:
    """The specs of --gguf-type: each kept layer gets the block type a recipe's block_type gives it, else the one
    llama.cpp's mix gives it (quantkit.gguf.mix; auto has no mix: a --target-bits allocation gives every layer one),
    as the quantizer settings that make it."""
    kept = {n: shapes[n] for n, s in specs.items() if s is not None}
    chosen = {n: specs[n].block_type for n in kept if specs[n].block_type is not None}
    missing = [n for n in kept if n not in chosen]
    if file_type == "auto" and missing:
        raise QuantkitError(f"--gguf-type auto chooses each tensor's block type for a budget: give --target-bits (or a "
                            f"recipe block_type for every quantized linear; {missing[0]} has none)")
    types = {**(gguf_mix.layer_types(file_type, kept, model_config, calibrated) if missing else {}), **chosen}
    out = {}
    for name, spec in specs.items():
        settings = gguf_types.settings_of_type(types[name]) if spec is not None else None
        out[name] = settings and LayerSpec(settings["bits"], settings["group_size"], settings["sym"],
                                           settings["quantizer"])
    return out


def unit_misfits(specs: dict, shapes: dict) -> dict:
    """{name: reason} of the layers whose inputs do not split into their quantizer's units (E8 rounds 8 columns at
    a time); specs and shapes from layer_specs."""
    refused = {}
    for name, spec in specs.items():
        if spec is None:
            continue
        try:
            check_shape(spec.quantizer(), shapes[name][0], spec.group_size, rows=shapes[name][1])
        except QuantkitError as e:
            refused[name] = e
    return refused


def skip_override(names) -> dict:
    """The recipe override that keeps these layers, and their namesakes in every block, in floating point."""
    leaves = {re.sub(r"^.*?\.\d+\.", "", n) for n in names}  # after the block index: mlp.down_proj, fc2
    return {"pattern": "(" + "|".join(re.escape(leaf) for leaf in sorted(leaves)) + ")$", "skip": True}


def _check_units(specs: dict, shapes: dict) -> None:
    """unit_misfits checked before any work; the error names the layers and the override that skips them."""
    refused = unit_misfits(specs, shapes)
    if refused:
        first, reason = next(iter(refused.items()))
        more = f" (and {len(refused) - 1} more layers)" if len(refused) > 1 else ""
        raise QuantkitError(f"{first}{more}: {reason}. Keep such layers in floating point with a recipe override "
                            f"(modules: - pattern: '{skip_override(refused)['pattern']}' skip: true)")

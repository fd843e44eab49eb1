"""Which serving stacks will refuse the checkpoint a run is about to write, told before any work.

Each rule below is what a reader's own code does with a GPTQ checkpoint (docs/FORMAT.md has the table
and the source files):
  vLLM         quantization/auto_gptq.py: AutoGPTQConfig.TYPE_MAP holds (4, sym) and (8, sym) only, anything
               else raises "Unsupported quantization config"; scales/qzeros are allocated input_size //
               group_size rows, so a short last group fails the shape check. utils/marlin_utils.py:
               MARLIN_SUPPORTED_GROUP_SIZES = [-1, 32, 64, 128]. utils/gptq_utils.py: "dynamic" rules are
               matched against the fused layer (qkv_proj, gate_up_proj), one setting per fused group.
  transformers utils/quantization_config.py GPTQConfig has no "dynamic": every linear is built with the
               base bits/group size, so a recipe with per-module overrides or skips does not load; its
               kernels are GPTQModel's (below).
               A quantized lm_head (quantization_config "lm_head": true, what vLLM's GPTQConfig reads as
               lm_head_quantized) is not loaded: its quantizer keeps the output embeddings in float.
  GPTQModel    nn_modules/qlinear/torch.py TorchLinear (its most permissive kernel): group_size in
               [-1, 16, 32, 64, 128, 256, 512, 1024] or equal to in_features; short last groups are padded.
               models/loader.py: an asymmetric checkpoint_format "gptq" (v1) folder loads only when its meta
               says GPTQModel made it (`not qcfg.sym and not qcfg.is_quantized_by_v2()` raises "Loading of a
               sym=False model with format=gptq is only supported if produced by gptqmodel"). 3-bit: GPTQModel
               7.6.0 refused layers whose out_features do not divide by 32 (issue 38's trial: its 3-bit
               packing works in blocks of 32 values, three words each).
compressed-tensors output (ct_problems):
  vLLM         compressed_tensors/schemes/compressed_tensors_wNa16.py: WNA16_SUPPORTED_TYPES_MAP {4: uint4b8,
               8: uint8b128} (asymmetric: WNA16_ZP_SUPPORTED_TYPES_MAP {4, 8}), scales allocated
               input_size // group_size columns (no short last group), the kernel Marlin's group sizes.
  transformers through the compressed-tensors library: quantization/lifecycle/forward_helpers.py raises "tensor
               column shape must be divisble by the given group_size" (0.17 to 0.20) for a short last group.
AWQ output: every rule of vLLM's awq.py (4 bits; in_features % group_size; out_features % 8) is a refusal of
AutoAWQCodec.precheck already, so no reader refuses what it writes.
Every reader refuses quant_method "quantkit" (rotated or codebook layers): only quantkit reads it.
"""
from dataclasses import dataclass

from quantkit.core.errors import QuantkitError

READERS = ("vllm", "transformers", "gptqmodel")
VLLM_TYPES = {(4, True), (8, True)}
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
GPTQMODEL_GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Problem:
    reader: str
    reason: str
    fix: str


def gptq_problems(config, specs: dict, shapes: dict, fused: dict) -> list[Problem]:
    """Problems of a GPTQ-layout run's settings per reader (what GPTQCodec.compat_problems reports).

    specs {linear: LayerSpec, or None when left in float}; shapes {linear: (in_features, out_features)};
    fused {serving name: its linears} (quantkit.models.arch.fused_groups). Each codec states its readers' rules
    (quantkit.checkpoint.codecs); awq and compressed-tensors refuse what they cannot store in their precheck."""
    quantized = {n: s for n, s in specs.items() if s is not None}
    return (_vllm_types(quantized) + _group_sizes(quantized, shapes) + _short_groups(quantized, shapes)
            + _split_groups(specs, fused) + _overrides(config, specs) + _gptqmodel_v1_asym(config, quantized)
            + _gptqmodel_3bit(quantized, shapes) + _lm_head(config))


def ct_problems(config, specs: dict, shapes: dict, fused: dict) -> list[Problem]:
    """Problems of a compressed-tensors run's settings per reader (CompressedTensorsCodec.compat_problems)."""
    quantized = {n: s for n, s in specs.items() if s is not None}
    bad_bits = sorted({s.bits for s in quantized.values()} - {4, 8})
    out = [Problem("vllm", f"its WNA16 scheme serves 4- and 8-bit weights, not {bad_bits[0]}-bit", "--bits 4 (or 8)")
           ] if bad_bits else []
    out += [p for p in _group_sizes(quantized, shapes) if p.reader == "vllm"]
    out += _split_groups(specs, fused)
    short = _short_groups(quantized, shapes)
    return out + short + [Problem("transformers", p.reason.replace("(a short last group)", "(compressed-tensors "
                                  "refuses a short last group)"), p.fix) for p in short]


def _gptqmodel_v1_asym(config, quantized: dict) -> list[Problem]:
    if config.checkpoint_format != "gptq" or all(s.sym for s in quantized.values()):
        return []
    return [Problem("gptqmodel", "it loads asymmetric layers in checkpoint_format gptq (v1) only from folders its own "
                                 "quantizer made", "--checkpoint-format gptq_v2 (the zeros as they are)")]


def _gptqmodel_3bit(quantized: dict, shapes: dict) -> list[Problem]:
    odd = sorted(n for n, s in quantized.items() if s.bits == 3 and shapes[n][1] % 32)
    if not odd:
        return []
    return [Problem("gptqmodel", f"its 3-bit layers need out_features divisible by 32, and {odd[0]} has "
                                 f"{shapes[odd[0]][1]}", "--bits 4, or a recipe override giving such layers 4 bits")]


def _vllm_types(quantized: dict) -> list[Problem]:
    bad = sorted({(s.bits, s.sym) for s in quantized.values()} - VLLM_TYPES)
    if not bad:
        return []
    kinds = ", ".join(f"{b}-bit {'sym' if sym else 'asym'}" for b, sym in bad)
    return [Problem("vllm", f"its GPTQ path (Marlin) serves symmetric 4- and 8-bit only, not {kinds}",
                    "--bits 4 (or 8) --sym")]


def _group_sizes(quantized: dict, shapes: dict) -> list[Problem]:
    out = []
    for reader, allowed in (("vllm", MARLIN_GROUP_SIZES), ("transformers", GPTQMODEL_GROUP_SIZES),
                            ("gptqmodel", GPTQMODEL_GROUP_SIZES)):
        bad = sorted({s.group_size for n, s in quantized.items()
                      if s.group_size not in allowed and s.group_size != shapes[n][0]})
        if bad:
            out.append(Problem(reader, f"group size {bad[0]} has no kernel there",
                               f"--group-size one of {', '.join(map(str, allowed))}"))
    return out


def _short_groups(quantized: dict, shapes: dict) -> list[Problem]:
    short = {n: s.group_size for n, s in quantized.items() if s.group_size != -1 and shapes[n][0] % s.group_size}
    if not short:
        return []
    name = min(short)
    widths = sorted({shapes[n][0] for n in short})
    fits = [g for g in MARLIN_GROUP_SIZES[1:] if all(k % g == 0 for k in widths)]
    fix = f"--group-size {fits[-1]}" if fits else "--group-size -1"
    return [Problem("vllm", f"{name} has {shapes[name][0]} inputs, not a multiple of group size {short[name]} "
                            "(a short last group)", f"{fix}, which divides every layer's inputs")]


def _split_groups(specs: dict, fused: dict) -> list[Problem]:
    for serving, members in fused.items():
        if len({specs.get(m) for m in members}) > 1:
            return [Problem("vllm", f"{', '.join(m.rpartition('.')[2] for m in members)} of {serving} have different "
                                    "settings but vLLM loads them as one layer",
                            "drop split_fused: true from the recipe override so it covers the whole group")]
    return []


def _overrides(config, specs: dict) -> list[Problem]:
    base = (config.bits, config.group_size, config.sym)
    odd = sorted(n for n, s in specs.items() if s is None or (s.bits, s.group_size, s.sym) != base)
    if not odd:
        return []
    return [Problem("transformers", f"its GPTQConfig drops the 'dynamic' map, so {odd[0]} (a recipe override"
                                    f"{' or skip' if any(specs[n] is None for n in odd) else ''}) would be built "
                                    "with the base settings", "remove the recipe's modules: overrides")]


def _lm_head(config) -> list[Problem]:
    """A quantized lm_head is declared by quantization_config "lm_head": true, which vLLM (lm_head_quantized) and
    GPTQModel read; transformers keeps the output embeddings out of its quantized modules and builds lm_head in
    float, so its packed tensors do not load."""
    if not getattr(config, "lm_head", False):
        return []
    return [Problem("transformers", "it builds lm_head in float and cannot load a quantized one (--lm-head)",
                    "drop --lm-head, or load with quantkit, vLLM or GPTQModel")]


def lines(problems: list[Problem]) -> list[str]:
    """One line per reader: every reason with its fix."""
    by_reader = {}
    for p in problems:
        by_reader.setdefault(p.reader, []).append(f"{p.reason} (fix: {p.fix})")
    return [f"{reader} will refuse this checkpoint: {'; '.join(reasons)}" for reader, reasons in by_reader.items()]


def enforce(problems: list[Problem], target: str) -> list[str]:
    """QuantkitError when `target` (a reader, or "any") refuses; the warning lines of the rest."""
    fatal = [p for p in problems if target == "any" or p.reader == target]
    if fatal:
        raise QuantkitError(f"--compat {target}: {' | '.join(lines(fatal))}")
    return lines(problems)

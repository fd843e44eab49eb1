"""Which serving stacks will refuse the checkpoint a run is about to write, told before any work.

Each rule below is what a reader's own code does, with the version and the file it was read from (docs/FORMAT.md has
the table "who loads what"):
GPTQ output (gptq_problems):
  vLLM 0.33    quantization/auto_gptq.py (gptq, gptq_marlin and auto_gptq are one AutoGPTQConfig now): TYPE_MAP holds
               (4, sym) and (8, sym) only, anything else raises "Unsupported quantization config"; scales are
               allocated input_size // group_size rows, so a short last group fails; AutoGPTQLinearMethod calls
               verify_marlin_supported: group sizes utils/marlin_utils.py MARLIN_SUPPORTED_GROUP_SIZES = [-1, 32, 64,
               128]. utils/gptq_utils.py refuses desc_act=True with groups (quantkit writes static groups, desc_act
               false) and matches "dynamic" rules against the fused layer (qkv_proj, gate_up_proj).
  transformers 5.24  utils/quantization_config.py GPTQConfig has no "dynamic": every linear is built with the
               base bits/group size, so a recipe with per-module overrides or skips does not load; its kernels are
               GPTQModel's (below). A quantized lm_head is not loaded: its quantizer keeps the output embeddings in
               float. Experts that the model holds fused (transformers 5's mlp.experts.gate_up_proj) load randomly
               initialized from a GPTQ folder, with no error (issue 58's trial).
  GPTQModel 7.6  nn_modules/qlinear/torch.py TorchLinear (its most permissive kernel): group_size in
               [-1, 16, 32, 64, 128, 256, 512, 1024] or equal to in_features; short last groups are padded.
               models/loader.py: an asymmetric checkpoint_format "gptq" (v1) folder loads only when its meta
               says GPTQModel made it (`not qcfg.sym and not qcfg.is_quantized_by_v2()` raises "Loading of a
               sym=False model with format=gptq is only supported if produced by gptqmodel"). 3-bit: GPTQModel
               7.6.0 refused layers whose out_features do not divide by 32 (issue 38's trial: its 3-bit
               packing works in blocks of 32 values, three words each).
compressed-tensors output (ct_problems):
  vLLM 0.33    compressed_tensors/schemes/compressed_tensors_wNa16.py: WNA16_SUPPORTED_TYPES_MAP and
               WNA16_ZP_SUPPORTED_TYPES_MAP hold 2 to 8 bits, symmetric and asymmetric, packed as one dense bit
               stream (pack_factor Fraction(32, b), as compressed-tensors >= 0.18 and quantkit write it); scales
               input_size // group_size columns, and verify_group_size_divides_partition raises on a short last group.
               Kernels (kernels/linear/__init__.py): Machete, Marlin, Exllama, Triton for 4/8-bit; every other type
               only on Humming (humming-kernels 0.1.19, a dependency of vLLM), whose schema refuses groups under 16
               (humming/schema/humming.py).
  transformers 5.24 through the compressed-tensors library: quantization/lifecycle/forward_helpers.py raises "tensor
               column shape must be divisble by the given group_size" (0.17 to 0.20) for a short last group; from
               transformers 5.23, every asymmetric folder fails ("size mismatch for weight_zero_point", issue 58's
               trial, quantkit's and llm-compressor's folders alike).
Every pre-quantized output (transformers_renamed_floats, a warning: the reader loads it in the dtype it states):
  transformers 5.17 to 5.20  core_model_loading.py convert_and_load_state_dict_in_model loads a float tensor whose
               name conversion_mapping.py renames (Mixtral's block_sparse_moe.gate.weight, its mlp.gate.weight) in
               the dtype it is stored in, whatever dtype from_pretrained asks for (5.21 on: quantizers/base.py
               HfQuantizer.get_new_dtype casts it); issue 58's trial.
AWQ output: every rule of vLLM's awq.py (4 bits; in_features % group_size; out_features % 8) is a refusal of
AutoAWQCodec.precheck already, so no reader refuses what it writes.
quant_method "quantkit" (rotated or codebook layers): read by quantkit.load_quantized and by transformers'
AutoModelForCausalLM once quantkit is imported (quantkit.integrations.transformers); vLLM and GPTQModel refuse it.
"""
from dataclasses import dataclass

from quantkit.core.errors import QuantkitError

READERS = ("vllm", "transformers", "gptqmodel")
VLLM_TYPES = {(4, True), (8, True)}   # vLLM 0.33 auto_gptq.py TYPE_MAP
HUMMING_MIN_GROUP = 16                 # humming-kernels 0.1.19 schema/humming.py: groups of fewer weights refused
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
GPTQMODEL_GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Problem:
    """fatal False: the reader loads the checkpoint, but only the way `fix` says; a warning even for the --compat
    target (a refusal would turn away runs the reader serves: every Mixtral, which transformers 5.24 loads exactly)."""
    reader: str
    reason: str
    fix: str
    fatal: bool = True


def gptq_problems(config, specs: dict, shapes: dict, fused: dict, fused_experts=frozenset()) -> list[Problem]:
    """Problems of a GPTQ-layout run's settings per reader (what GPTQCodec.compat_problems reports).

    specs {linear: LayerSpec, or None when left in float}; shapes {linear: (in_features, out_features)};
    fused {serving name: its linears} (quantkit.models.arch.fused_groups); fused_experts: the linears of experts the model holds
    fused, which quantkit splits (quantkit.run.precheck.fused_expert_linears).
    Each codec states its readers' rules
    (quantkit.checkpoint.codecs); awq and compressed-tensors refuse what they cannot store in their precheck."""
    quantized = {n: s for n, s in specs.items() if s is not None}
    return (_vllm_types(quantized) + _group_sizes(quantized, shapes) + _short_groups(quantized, shapes)
            + _split_groups(specs, fused) + _overrides(config, specs) + _gptqmodel_v1_asym(config, quantized)
            + _gptqmodel_3bit(quantized, shapes) + _lm_head(config) + _transformers_gptq_experts(quantized, fused_experts))


def ct_problems(config, specs: dict, shapes: dict, fused: dict) -> list[Problem]:
    """Problems of a compressed-tensors run's settings per reader (CompressedTensorsCodec.compat_problems)."""
    quantized = {n: s for n, s in specs.items() if s is not None}
    out = _humming_groups(quantized) + _split_groups(specs, fused)
    short = _short_groups(quantized, shapes)
    out += short + [Problem("transformers", p.reason.replace("(a short last group)", "(compressed-tensors refuses a "
                            "short last group)"), p.fix) for p in short]
    return out + _transformers_asym_ct(quantized)


def _humming_groups(quantized: dict) -> list[Problem]:
    """vLLM 0.33 serves compressed-tensors at 2-8 bits; what only Humming runs (every type but symmetric 4/8-bit,
    which Machete, Marlin and Exllama also take) needs groups of 16 or more weights."""
    small = sorted({s.group_size for s in quantized.values() if 0 < s.group_size < HUMMING_MIN_GROUP
                    and not (s.bits in (4, 8) and s.sym)})
    if not small:
        return []
    return [Problem("vllm", f"group size {small[0]} is under the {HUMMING_MIN_GROUP} its Humming kernel needs for "
                            "these weights", f"--group-size {HUMMING_MIN_GROUP} or more (or -1)")]


def _transformers_gptq_experts(quantized: dict, fused_experts) -> list[Problem]:
    """transformers 5.24 builds a mixture-of-experts model's experts fused (mlp.experts.gate_up_proj, down_proj) and
    its GPTQ path (integrations/gptq.py, GPTQModel's QuantLinear per nn.Linear) has nothing to put per-expert qweight
    tensors into: they are reported UNEXPECTED, the fused experts MISSING, and the model runs with random experts,
    no error raised (issue 58's trial: Mixtral argmax agreement 0.45 with quantkit's own load, Qwen3-MoE 0.73)."""
    expert = sorted(n for n in quantized if n in fused_experts)
    if not expert:
        return []
    return [Problem("transformers", f"it loads a GPTQ mixture-of-experts folder with its experts randomly initialized "
                                    f"and no error ({expert[0]} and every other expert linear would be dropped)",
                    "--checkpoint-format compressed-tensors, which transformers loads exactly, experts included")]


def _transformers_asym_ct(quantized: dict) -> list[Problem]:
    """transformers >= 5.23 with compressed-tensors 0.20 fails on every asymmetric folder, quantkit's and
    llm-compressor's alike: its weight_zero_point parameter is built with a shape the stored zeros do not have
    ("size mismatch for weight_zero_point", issue 58's trial)."""
    if all(s.sym for s in quantized.values()):
        return []
    return [Problem("transformers", "transformers 5.23 and later refuse asymmetric compressed-tensors folders "
                                    "(a size mismatch for weight_zero_point)",
                    "--sym; or keep asymmetric weights and load them with quantkit.load_quantized or vLLM")]


def renamed_floats(kinds: dict, of_tensor) -> list[str]:
    """The files' names of the float weights a run writes unquantized (kinds: quantkit.run.coverage.Coverage.kinds,
    every kind but "quantized") that the model names otherwise (of_tensor: quantkit.models.names.FileNames.of_tensor):
    what transformers_renamed_floats is about. Norms and biases are left out: multiplied elementwise, a stored dtype
    only promotes, where a matmul or lookup of a weight in another dtype than the activations raises."""
    return sorted(of_tensor(n) for kind, names in kinds.items() if kind != "quantized" for n in names
                  if of_tensor(n) != n)


def transformers_renamed_floats(renamed: list[str]) -> list[Problem]:
    """transformers 5.17 to 5.20 load a pre-quantized checkpoint's float tensor in the dtype it is stored in when
    conversion_mapping.py renames it (core_model_loading.py convert_and_load_state_dict_in_model: `original_key !=
    renamed_key` -> no cast), so any other dtype crashes the forward: issue 58's trial, a compressed-tensors Mixtral
    written from fp16, dtype=torch.float32 or bfloat16 in 5.17.0 and 5.20.0, "expected m1 and m2 to have the same
    dtype" in MixtralTopKRouter.forward (the router, block_sparse_moe.gate, stays fp16); the default dtype ("auto", the
    config's) loads, and 5.21.0 and 5.24.0 load every dtype. No layout loads in all: a router stored in float32 fails
    the default load instead, and one under the model's name (mlp.gate) is refused by vLLM's loader."""
    if not renamed:
        return []
    more = f" and {len(renamed) - 1} more" if len(renamed) > 1 else ""
    return [Problem("transformers", f"transformers 5.17 to 5.20 load {renamed[0]}{more} in the dtype the checkpoint "
                                    "stores, as they rename it on load, so from_pretrained with another dtype fails "
                                    "on the first forward",
                    "load it with the dtype config.json states (from_pretrained's default dtype='auto'), or with "
                    "transformers 5.21 or later", fatal=False)]


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
    return [Problem("vllm", f"its GPTQ path serves symmetric 4- and 8-bit only, not {kinds}",
                    "--checkpoint-format compressed-tensors (vLLM serves 2- to 8-bit weights, symmetric or not, "
                    "there), or --bits 4 (or 8) --sym")]


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
    """One line per reader and severity: every reason with its fix."""
    by_reader = {}
    for p in problems:
        by_reader.setdefault((p.reader, p.fatal), []).append(f"{p.reason} (fix: {p.fix})")
    return [f"{reader} {'will refuse' if fatal else 'may fail on'} this checkpoint: {'; '.join(reasons)}"
            for (reader, fatal), reasons in by_reader.items()]


def enforce(problems: list[Problem], target: str) -> list[str]:
    """QuantkitError when `target` (a reader, or "any") refuses (a fatal problem); the warning lines of the rest,
    the target's non-fatal ones included."""
    fatal = [p for p in problems if p.fatal and (target == "any" or p.reader == target)]
    if fatal:
        raise QuantkitError(f"--compat {target}: {' | '.join(lines(fatal))}")
    return lines(problems)

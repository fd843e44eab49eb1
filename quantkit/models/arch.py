"""Architecture knowledge as data, read: which family table entry (quantkit.models.families) a model takes, each
block's stages, routers, fused groups and context length; GPT-2's Conv1D weights as [out, in]."""
import re
from dataclasses import replace

import torch
from torch import nn

from quantkit.core.errors import QuantkitError
from quantkit.models.families import ARCHS, Arch  # noqa: F401 (ARCHS and Arch re-exported)
from quantkit.models.moe import ExpertLinears


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D: a linear layer whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D"


def get_weight(module: nn.Module) -> torch.Tensor:
    """Weight as [out, in] (GPT-2's Conv1D stores [in, out])."""
    w = module.weight.data
    return w.t() if is_conv1d(module) else w


def set_weight(module: nn.Module, w: torch.Tensor) -> None:
    w = w.t() if is_conv1d(module) else w
    module.weight.data.copy_(w.to(module.weight.dtype))


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or GPT-2's Conv1D."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError as e:
        raise QuantkitError(f"model has no module '{path}' ({e}): its architecture table entry is wrong") from e


def decoder_path(model: nn.Module) -> str:
    """Dotted path of the language model's decoder (transformers' get_decoder()): "model" for a causal LM,
    "model.language_model" for a vision-language model, whose vision tower stays in floating point; "" if unknown.
    What get_decoder() gives holds the blocks (a ModuleList), else it is not the decoder and the base model stands
    in: ModernBERT-decoder's get_decoder() finds its output linear, named `decoder`."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and not any(isinstance(m, nn.ModuleList) for m in decoder.modules()):
        decoder = getattr(model, "base_model", None)
    return next((name for name, mod in model.named_modules() if mod is decoder and name), "")


def find_blocks_path(model: nn.Module) -> str:
    """The outermost ModuleList whose entries hold linears, inside the language model's decoder (the longest of
    those at that depth): the decoder blocks of an unknown family. A list inside a block (LongCat-Flash's two
    attentions per layer, a split MoE layer's experts) is not the blocks, however long; a vision tower's neither."""
    best, best_key = None, None
    root = decoder_path(model)
    for name, mod in model.named_modules():
        if root and not name.startswith(root + "."):
            continue
        if isinstance(mod, nn.ModuleList) and not isinstance(mod, ExpertLinears) and len(mod):
            key = (-name.count("."), len(mod))
            if (best_key is None or key > best_key) and any(is_linear(m) for m in mod[0].modules()):
                best, best_key = name, key
    if best is None:
        raise QuantkitError("could not find the decoder blocks of this model: add its family to "
                            "quantkit/models/families.py")
    return best


def arch_for(model: nn.Module) -> Arch:
    model_type = getattr(model.config, "model_type", None)
    if model_type in ARCHS:
        return _per_expert(ARCHS[model_type], expert_count(model.config) or 0)
    text_type = getattr(getattr(model.config, "text_config", None), "model_type", None)
    if text_type in ARCHS:  # a vision-language model: its language model's blocks, by the text family's entry
        return replace(_per_expert(ARCHS[text_type], expert_count(model.config) or 0), blocks=find_blocks_path(model))
    blocks = get_submodule(model, find_blocks_path(model))
    arch = Arch(blocks=find_blocks_path(model), sequential=(), found_by_shape=True,
                experts=expert_count(model.config) or 0)
    return replace(arch, sequential=block_stages(arch, blocks[0]))


def _per_expert(arch: Arch, experts: int) -> Arch:
    """The entry with every "*" of its stages expanded to the model's experts, expert by expert."""
    def expand(stage):
        plain = tuple(n for n in stage if "*" not in n)
        return tuple(n.replace("*", str(e)) for e in range(experts) for n in stage if "*" in n) + plain
    return replace(arch, sequential=tuple(expand(stage) for stage in arch.sequential))


# config fields that give a mixture-of-experts model's number of routed experts
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
ROUTER_NAME = re.compile(r"(^|\.)(router|gate)$")


def expert_count(model_config) -> int | None:
    """The number of routed experts of a mixture-of-experts model (its text model's, for a VLM); None if dense."""
    configs = [model_config, getattr(model_config, "text_config", None)]
    return next((getattr(c, f) for c in configs if c is not None for f in EXPERT_COUNT_FIELDS
                 if isinstance(getattr(c, f, None), int)), None)


def is_router(module_name: str, weight, experts: int | None) -> bool:
    """A mixture-of-experts router: a module named router or gate whose weight is [experts, hidden]. Routers stay
    in floating point: rounding them moves routing decisions."""
    if not experts or weight.dim() != 2:
        return False
    routes = weight.shape[0] == experts and ROUTER_NAME.search(module_name)
    return bool(routes or (weight.shape[0] == 1 and module_name.endswith("shared_expert_gate")))


def require_scale_groups(arch: Arch, model_type: str = "this model family") -> None:
    if not arch.scale_groups:
        raise QuantkitError(
            f"AWQ has no scale-group table for model_type '{model_type}': add which norm or linear "
            "feeds which linears to ARCHS in quantkit/models/families.py, or use --method gptq/rtn")


def for_block(arch: Arch, block: nn.Module, uses=None) -> Arch:
    """The entry as it applies to `block`, whose traced uses (quantkit.models.uses.BlockUses) say which of its weights
    its forward multiplies as linear layers. A family found by shape takes the trace's stages; a table family its
    table's stages, narrowed to the linears the block has and multiplies (DeepSeek's dense and MoE layers differ),
    then any linear the trace found that the table does not list, in the trace's order. Without a trace: the table's
    stages narrowed to the modules the block has, or for a family found by shape its linears (routers by name left
    out) as one stage."""
    if arch.found_by_shape:
        stages = uses.stages if uses is not None else (tuple(n for n, m in block.named_modules() if is_linear(m)),)
        # a router its trace did not see select (PhiMoE's sparsemixer masks with max, not top-k) is still one by name
        stages = tuple(s for s in (tuple(n for n in stage if not is_router(n, get_weight(block.get_submodule(n)),
                                                                           arch.experts)) for stage in stages) if s)
        return replace(arch, sequential=stages)
    if uses is None and not arch.varies:
        return arch
    has = {name for name, _ in block.named_modules()} if uses is None else uses.linears
    stages = tuple(s for s in (tuple(n for n in stage if n in has) for stage in arch.sequential) if s)
    if uses is not None:
        listed = {n for stage in stages for n in stage}
        stages += tuple(s for s in (tuple(n for n in stage if n not in listed) for stage in uses.stages) if s)
    has = {name for name, _ in block.named_modules()}
    groups = tuple((prev, present) for prev, names in arch.scale_groups
                   if prev in has and (present := tuple(n for n in names if n in has)))
    if uses is not None:  # a group with a linear left in float (a router, one read by the model's code) is not scaled
        quantized = {n for stage in stages for n in stage}
        groups = tuple((prev, names) for prev, names in groups if set(names) <= quantized)
    reusable = tuple((sub, tail) for sub, tail in arch.reusable if tail in has)
    feeds_only = tuple((m, sub) for m, sub in arch.feeds_only if any(sub == r for r, _ in reusable))
    return replace(arch, sequential=stages, scale_groups=groups, reusable=reusable, feeds_only=feeds_only)


def block_stages(arch: Arch, block: nn.Module, uses=None) -> tuple[tuple[str, ...], ...]:
    """The true-sequential stages of one block (see for_block)."""
    return for_block(arch, block, uses).sequential


def block_linears(arch: Arch, block: nn.Module | None = None, uses=None) -> list[str]:
    """The linears to quantize in a block (in `block`, for a family found by shape; as traced, given its uses)."""
    stages = block_stages(arch, block, uses) if block is not None else arch.sequential
    return [name for stage in stages for name in stage]


def fused_groups(arch: Arch, names) -> dict[str, tuple[str, ...]]:
    """{full serving name: full names of its linears} for every fused group among `names`
    ("model.layers.0.self_attn.qkv_proj" -> (".q_proj", ".k_proj", ".v_proj" of that block))."""
    present, groups = set(names), {}
    for name in names:
        for fused, members in arch.fused:
            if name.endswith("." + members[0]):
                prefix = name[: -len(members[0])]
                full = tuple(prefix + m for m in members)
                if all(m in present for m in full):
                    groups[prefix + fused] = full
    return groups


def fused_siblings(arch: Arch, names) -> dict[str, tuple[str, ...]]:
    """{full linear name: the other linears of its fused group}."""
    out = {}
    for members in fused_groups(arch, names).values():
        for m in members:
            out[m] = tuple(x for x in members if x != m)
    return out


# config.json fields that bound the positions a model was built for: a learned position table (GPT-2, OPT) has no
# row past them, and a RoPE model was never trained there. transformers maps most families onto the first.
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(model_config) -> int | None:
    """The longest window the model takes: its config's context field, times a RoPE scaling factor where one is
    declared (Llama 3.1 and Qwen's yarn store the scaled length, a linear or dynamic scaling the original one:
    the larger reading is taken). None when the config names no context."""
    limit = next((int(v) for f in CONTEXT_FIELDS if isinstance(v := getattr(model_config, f, None), int)), None)
    if limit is None:
        return None
    params = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    per_layer_type = [p for p in params.values() if isinstance(p, dict)] if isinstance(params, dict) else []
    for p in per_layer_type or [params]:
        kind = p.get("rope_type", p.get("type", "default")) if isinstance(p, dict) else "default"
        if kind != "default" and isinstance(p.get("factor"), (int, float)):
            limit = max(limit, int(p.get("original_max_position_embeddings", limit) * p["factor"]))
    return limit


def vocabulary(model_config) -> int:
    """The model's vocabulary size (a vision-language model's text config's), 2 when its config does not say."""
    return getattr(model_config, "vocab_size", None) or getattr(
        getattr(model_config, "text_config", None), "vocab_size", None) or 2


def check_window(model_config, length: int, what: str, fix=lambda limit: f"use --seqlen {limit} or less") -> None:
    """Refuse `length` tokens past the model's context (`what` names them, e.g. '--seqlen 4096'; fix(limit) says
    what to do instead): past it a learned position table fails with an index error and a RoPE model computes
    activations it never saw."""
    limit = context_length(model_config)
    if limit is not None and length > limit:
        raise QuantkitError(f"{what} is longer than the model's context of {limit} tokens (its config.json's "
                            f"max_position_embeddings or equivalent): {fix(limit)}")

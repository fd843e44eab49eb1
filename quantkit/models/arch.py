"""Architecture knowledge as data: one small entry per model family, no subclass per model.

For each `config.model_type`:
  blocks      dotted path from the CausalLM to the ModuleList of decoder blocks
  sequential  the block's linears in true-sequential order, as stages: a stage's linears read the same
              input, and a later stage reads outputs of an earlier one (q/k/v, then o, then gate/up, ...)
  scale_groups (AWQ) each (prev_op, linears): the op whose output feeds exactly those linears, into which
              1/s is folded. prev_op is a norm (weight, bias) or a linear whose output dim equals the
              linears' input dim with only a positively homogeneous op between (v->o, up->down,
              fc1->ReLU->fc2). A group whose shapes don't allow folding (v->o under GQA) is skipped at
              run time.
  norm_offset Gemma-style RMSNorm computes x * (1 + weight); folding must respect it.
  reusable    (submodule, its output linear) pairs whose work the calibration loop does not repeat
              (quantkit.calibration.replay): the output linear's input, recorded once the submodule's other linears are
              quantized, and the submodule's output, once all are; the attention (o_proj) and the MLP (down_proj)
  feeds_only  (module, reusable submodule) pairs: the module's output is read by that submodule alone (the norm
              before the attention, the one before the MLP), so while the submodule is replayed it is not run
              either. Not for post-LN or parallel blocks (OPT-350m, phi), whose norms feed the residual or both.
  fused       each (serving name, linears): linears that vLLM loads into one fused layer of that name
              (q/k/v -> qkv_proj, gate/up -> gate_up_proj), so they must share one quantization setting;
              recipe overrides apply to the whole group and the GPTQ `dynamic` map names both spellings.
  varies      the family's blocks are of more than one kind (dense and mixture-of-experts layers): the table lists
              the linears of all kinds and each block takes those it has (for_block)
An unknown family still quantizes with RTN/GPTQ (blocks found by shape, all linears in one stage);
AWQ needs an entry and says what is missing.
"""
import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from quantkit.core.errors import QuantkitError
from quantkit.models.moe import ExpertLinears


@dataclass(frozen=True)
class Arch:
    """blocks: path of the decoder blocks' ModuleList. sequential: the true-sequential stages, in order; the
    linears of one stage are fed from one point of the block, never from one another's outputs (the
    calibration loop relies on it: it does not compute a stage's own linears while observing them).
    scale_groups: (previous op, the linears it feeds) pairs AWQ can scale; norm_offset: Gemma's 1 + weight
    norms; reusable: (submodule, output linear) pairs replayed once final (the attention, the MLP: nothing
    downstream of a later stage may feed them); feeds_only: (module, reusable submodule) pairs, the module's
    output read by the submodule alone; fused: the groups a server fuses into one layer (one setting each);
    varies: blocks of more than one kind, each narrowed to what it has (for_block)."""
    blocks: str
    sequential: tuple[tuple[str, ...], ...]
    scale_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()
    norm_offset: float = 0.0
    reusable: tuple[tuple[str, str], ...] = ()
    feeds_only: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    found_by_shape: bool = False  # an unknown family: each block's stage is its own linears (blocks may differ)
    varies: bool = False          # blocks of more than one kind (dense and MoE layers): each takes what it has
    experts: int = 0              # its routed experts (whose routers are not linears to quantize)


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# vLLM's packed_modules_mapping (vllm/model_executor/models/llama.py, LlamaForCausalLM; the Llama-style families share it)
_LLAMA_FUSED = (("self_attn.qkv_proj", _QKV), ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))

_LLAMA = Arch(
    blocks="model.layers",
    sequential=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
    scale_groups=(("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                  ("self_attn.v_proj", ("self_attn.o_proj",)),
                  ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
                  ("mlp.up_proj", ("mlp.down_proj",))),
    reusable=(("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj")),
    feeds_only=(("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")),
    fused=_LLAMA_FUSED,
)

# Gemma 2 and 3: (1 + w) norms, and four of them: post_attention_layernorm and post_feedforward_layernorm normalise
# the sublayers' outputs; the MLP reads pre_feedforward_layernorm's.
_GEMMA2 = replace(
    _LLAMA, norm_offset=1.0,
    scale_groups=(("input_layernorm", _QKV), ("self_attn.v_proj", ("self_attn.o_proj",)),
                  ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")), ("mlp.up_proj", ("mlp.down_proj",))),
    feeds_only=(("input_layernorm", "self_attn"), ("pre_feedforward_layernorm", "mlp")),
)

# Mixture-of-experts blocks once their experts are split into one module each (quantkit.models.moe): "*" stands
# for every expert (expanded by arch_for). The router stays in float; AWQ scales the attention only, because the
# norm before the experts also feeds the router.
_MOE = Arch(
    blocks="model.layers",
    sequential=(_QKV, ("self_attn.o_proj",), ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"),
                ("mlp.experts.*.down_proj",)),
    scale_groups=(("input_layernorm", _QKV), ("self_attn.v_proj", ("self_attn.o_proj",))),
    reusable=(("self_attn", "self_attn.o_proj"),),
    feeds_only=(("input_layernorm", "self_attn"),),
    fused=(("self_attn.qkv_proj", _QKV),),
)
# Qwen2-MoE adds a shared expert beside the routed ones (and a one-row gate for it, kept in float)
_SHARED_EXPERT = replace(_MOE, sequential=(
    _QKV, ("self_attn.o_proj",),
    ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    ("mlp.experts.*.down_proj", "mlp.shared_expert.down_proj")))

# DeepSeek-V2/V3's multi-head latent attention: q (or its low-rank pair q_a -> q_a_layernorm -> q_b) and the
# compressed kv (kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj), then o; dense first layers beside MoE layers
# with shared experts. The table lists both kinds of block (and both q spellings); each block takes the linears
# and groups it has (`varies`). AWQ folds into the three norms in front of linears and into up -> down; the norm
# before a MoE layer also feeds its router, so that one is not scaled.
_MLA = Arch(
    blocks="model.layers",
    sequential=(("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
                ("self_attn.q_b_proj", "self_attn.kv_b_proj"), ("self_attn.o_proj",),
                ("mlp.gate_proj", "mlp.up_proj", "mlp.experts.*.gate_proj", "mlp.experts.*.up_proj",
                 "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
                ("mlp.down_proj", "mlp.experts.*.down_proj", "mlp.shared_experts.down_proj")),
    scale_groups=(("input_layernorm", ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
                  ("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
                  ("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
                  ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
                  ("mlp.up_proj", ("mlp.down_proj",)),
                  ("mlp.shared_experts.up_proj", ("mlp.shared_experts.down_proj",))),
    reusable=(("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj")),
    feeds_only=(("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")),
    # vLLM's DeepseekV2ForCausalLM packed_modules_mapping (vllm/model_executor/models/deepseek_v2.py)
    fused=(("self_attn.fused_qkv_a_proj", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
           ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))),
    varies=True,
)

# Llama 4: MoE layers (routed experts beside a shared expert) interleaved with dense ones, all under feed_forward
_FF = ("feed_forward.gate_proj", "feed_forward.up_proj")
_LLAMA4 = Arch(
    blocks="model.layers",
    sequential=(_QKV, ("self_attn.o_proj",),
                _FF + ("feed_forward.experts.*.gate_proj", "feed_forward.experts.*.up_proj",
                       "feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj"),
                ("feed_forward.down_proj", "feed_forward.experts.*.down_proj", "feed_forward.shared_expert.down_proj")),
    scale_groups=(("input_layernorm", _QKV), ("self_attn.v_proj", ("self_attn.o_proj",)),
                  ("post_attention_layernorm", _FF), ("feed_forward.up_proj", ("feed_forward.down_proj",)),
                  ("feed_forward.shared_expert.up_proj", ("feed_forward.shared_expert.down_proj",))),
    reusable=(("self_attn", "self_attn.o_proj"), ("feed_forward", "feed_forward.down_proj")),
    feeds_only=(("input_layernorm", "self_attn"), ("post_attention_layernorm", "feed_forward")),
    fused=(("self_attn.qkv_proj", _QKV), ("feed_forward.gate_up_proj", _FF)),
    varies=True,
)

ARCHS: dict[str, Arch] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma": replace(_LLAMA, norm_offset=1.0),
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA2,
    "granite": _LLAMA,  # Llama's blocks with scalar multipliers on the residual and the attention
    # GLM-4: Llama's order with a fused gate_up_proj and two more norms on the sublayers' outputs (no fold there)
    "glm4": Arch(
        blocks="model.layers",
        sequential=(_QKV, ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
        scale_groups=(("input_layernorm", _QKV), ("self_attn.v_proj", ("self_attn.o_proj",)),
                      ("post_attention_layernorm", ("mlp.gate_up_proj",))),
        reusable=(("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj")),
        feeds_only=(("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")),
        fused=(("self_attn.qkv_proj", _QKV),),
    ),
    # OLMo 2 normalises the sublayers' outputs, not their inputs: the attention and the MLP read the residual
    # stream itself, so only v -> o and up -> down can be scaled
    "olmo2": replace(_LLAMA, scale_groups=(("self_attn.v_proj", ("self_attn.o_proj",)), ("mlp.up_proj", ("mlp.down_proj",))),
                     feeds_only=()),
    # Cohere (Command R): a parallel block, one LayerNorm feeding the attention and the MLP
    "cohere": Arch(
        blocks="model.layers",
        sequential=(_QKV + ("mlp.gate_proj", "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj")),
        scale_groups=(("input_layernorm", _QKV + ("mlp.gate_proj", "mlp.up_proj")),
                      ("self_attn.v_proj", ("self_attn.o_proj",)), ("mlp.up_proj", ("mlp.down_proj",))),
        reusable=(("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj")),
        fused=_LLAMA_FUSED,
    ),
    "starcoder2": Arch(
        blocks="model.layers",
        sequential=(_QKV, ("self_attn.o_proj",), ("mlp.c_fc",), ("mlp.c_proj",)),
        # c_fc -> GELU -> c_proj: GELU is not positively homogeneous, so that pair is not scaled
        scale_groups=(("input_layernorm", _QKV), ("self_attn.v_proj", ("self_attn.o_proj",)),
                      ("post_attention_layernorm", ("mlp.c_fc",))),
        reusable=(("self_attn", "self_attn.o_proj"), ("mlp", "mlp.c_proj")),
        feeds_only=(("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")),
        fused=(("self_attn.qkv_proj", _QKV),),
    ),
    # the language models of the Qwen vision-language models (their config's text_config.model_type)
    "qwen2_vl_text": _LLAMA,
    "qwen2_5_vl_text": _LLAMA,
    "qwen3_vl_text": _LLAMA,
    "mixtral": _MOE,
    "qwen3_moe": _MOE,
    "gpt_oss": _MOE,
    "qwen2_moe": _SHARED_EXPERT,
    "llama4_text": _LLAMA4,
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "opt": Arch(
        blocks="model.decoder.layers",
        sequential=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.out_proj",),
                    ("fc1",), ("fc2",)),
        scale_groups=(("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                      ("self_attn.v_proj", ("self_attn.out_proj",)),
                      ("final_layer_norm", ("fc1",)),
                      ("fc1", ("fc2",))),  # ReLU between: relu(x/s) = relu(x)/s for s > 0
        reusable=(("self_attn", "self_attn.out_proj"),),  # fc1/fc2 sit in the block itself
    ),
    "gpt_neox": Arch(
        blocks="gpt_neox.layers",
        sequential=(("attention.query_key_value",), ("attention.dense",), ("mlp.dense_h_to_4h",),
                    ("mlp.dense_4h_to_h",)),
        scale_groups=(("input_layernorm", ("attention.query_key_value",)),
                      ("post_attention_layernorm", ("mlp.dense_h_to_4h",))),
        reusable=(("attention", "attention.dense"), ("mlp", "mlp.dense_4h_to_h")),
        feeds_only=(("input_layernorm", "attention"), ("post_attention_layernorm", "mlp")),  # also parallel residual
    ),
    "gpt2": Arch(
        blocks="transformer.h",
        sequential=(("attn.c_attn",), ("attn.c_proj",), ("mlp.c_fc",), ("mlp.c_proj",)),
        scale_groups=(("ln_1", ("attn.c_attn",)), ("ln_2", ("mlp.c_fc",))),
        reusable=(("attn", "attn.c_proj"), ("mlp", "mlp.c_proj")),
        feeds_only=(("ln_1", "attn"), ("ln_2", "mlp")),
    ),
    "phi": Arch(
        blocks="model.layers",
        sequential=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1"),
                    ("self_attn.dense", "mlp.fc2")),
        # parallel block: one norm feeds attention and MLP
        scale_groups=(("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1")),
                      ("self_attn.v_proj", ("self_attn.dense",))),
        reusable=(("self_attn", "self_attn.dense"), ("mlp", "mlp.fc2")),
    ),
    "phi3": Arch(
        blocks="model.layers",
        sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
        scale_groups=(("input_layernorm", ("self_attn.qkv_proj",)),
                      ("post_attention_layernorm", ("mlp.gate_up_proj",))),
        reusable=(("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj")),
        feeds_only=(("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")),
    ),
}


# How a family's original checkpoint files name tensors that the model holds under other names once transformers
# (and quantkit.models.moe) converted them: (pattern on the in-memory name, its name in the files). Mixtral's experts
# are w1 (gate), w3 (up), w2 (down) under block_sparse_moe; the streamed reader reads them block by block so.
SOURCE_NAMES = {
    "mixtral": ((r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".block_sparse_moe.experts.\1.w1."),
                (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".block_sparse_moe.experts.\1.w3."),
                (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".block_sparse_moe.experts.\1.w2."),
                (r"\.mlp\.gate\.", r".block_sparse_moe.gate.")),
}


def name_in_files(model_type: str, name: str) -> str:
    """The name tensor `name` has in the family's original checkpoint files (itself when they agree)."""
    for pattern, stored in SOURCE_NAMES.get(model_type, ()):
        renamed = re.sub(pattern, stored, name)
        if renamed != name:
            return renamed
    return name


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
    "model.language_model" for a vision-language model, whose vision tower stays in floating point; "" if unknown."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return next((name for name, mod in model.named_modules() if mod is decoder and name), "")


def find_blocks_path(model: nn.Module) -> str:
    """The longest ModuleList whose entries hold linears, inside the language model's decoder: the decoder blocks of
    an unknown family (a split MoE layer's experts are not blocks, however many; a vision tower's blocks neither)."""
    best, best_len = None, 0
    root = decoder_path(model)
    for name, mod in model.named_modules():
        if root and not name.startswith(root + "."):
            continue
        if isinstance(mod, nn.ModuleList) and not isinstance(mod, ExpertLinears) and len(mod) > best_len:
            if any(is_linear(m) for m in mod[0].modules()):
                best, best_len = name, len(mod)
    if best is None:
        raise QuantkitError("could not find the decoder blocks of this model: add its family to quantkit/models/arch.py")
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
            "feeds which linears to ARCHS in quantkit/models/arch.py, or use --method gptq/rtn")


def for_block(arch: Arch, block: nn.Module) -> Arch:
    """The entry as it applies to `block`. For a family whose blocks differ, the stages, scale groups and reusable
    submodules narrowed to the modules this block has (DeepSeek's dense first layers and its MoE layers); for a
    family found by shape, the block's own linears (routers left out) as one stage."""
    if arch.found_by_shape:
        return replace(arch, sequential=(tuple(n for n, m in block.named_modules()
                                               if is_linear(m) and not is_router(n, m.weight, arch.experts)),))
    if not arch.varies:
        return arch
    has = {name for name, _ in block.named_modules()}
    stages = tuple(s for s in (tuple(n for n in stage if n in has) for stage in arch.sequential) if s)
    groups = tuple((prev, present) for prev, names in arch.scale_groups
                   if prev in has and (present := tuple(n for n in names if n in has)))
    reusable = tuple((sub, tail) for sub, tail in arch.reusable if tail in has)
    feeds_only = tuple((m, sub) for m, sub in arch.feeds_only if any(sub == r for r, _ in reusable))
    return replace(arch, sequential=stages, scale_groups=groups, reusable=reusable, feeds_only=feeds_only)


def block_stages(arch: Arch, block: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The true-sequential stages of one block (see for_block)."""
    return for_block(arch, block).sequential


def block_linears(arch: Arch, block: nn.Module | None = None) -> list[str]:
    """The linears to quantize in a block (in `block`, for a family found by shape)."""
    stages = block_stages(arch, block) if block is not None else arch.sequential
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


def check_window(model_config, length: int, what: str, fix=lambda limit: f"use --seqlen {limit} or less") -> None:
    """Refuse `length` tokens past the model's context (`what` names them, e.g. '--seqlen 4096'; fix(limit) says
    what to do instead): past it a learned position table fails with an index error and a RoPE model computes
    activations it never saw."""
    limit = context_length(model_config)
    if limit is not None and length > limit:
        raise QuantkitError(f"{what} is longer than the model's context of {limit} tokens (its config.json's "
                            f"max_position_embeddings or equivalent): {fix(limit)}")

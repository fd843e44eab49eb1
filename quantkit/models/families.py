"""The family table: one small entry per model family (config.model_type), no subclass per model.

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
AWQ needs an entry and says what is missing. What reads the table: quantkit.models.arch.
"""
from dataclasses import dataclass, replace


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

def _one_mlp_input(mlp_in: str, mlp_out: str) -> Arch:
    """Llama's block with one linear into the MLP (GLM-4's fused gate_up_proj, StarCoder2's c_fc). mlp_in -> mlp_out
    is not scaled: a SwiGLU over the halves of one output, or GELU, is not positively homogeneous."""
    return replace(_LLAMA, sequential=(_QKV, ("self_attn.o_proj",), (mlp_in,), (mlp_out,)),
                   scale_groups=(("input_layernorm", _QKV), ("self_attn.v_proj", ("self_attn.o_proj",)),
                                 ("post_attention_layernorm", (mlp_in,))),
                   reusable=(("self_attn", "self_attn.o_proj"), ("mlp", mlp_out)),
                   fused=(("self_attn.qkv_proj", _QKV),))


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
    "glm4": _one_mlp_input("mlp.gate_up_proj", "mlp.down_proj"),
    # OLMo 2 normalises the sublayers' outputs, not their inputs: the attention and the MLP read the residual
    # stream itself, so only v -> o and up -> down can be scaled
    "olmo2": replace(_LLAMA, feeds_only=(),
                     scale_groups=(("self_attn.v_proj", ("self_attn.o_proj",)), ("mlp.up_proj", ("mlp.down_proj",)))),
    # Cohere (Command R): a parallel block, one LayerNorm feeding the attention and the MLP
    "cohere": Arch(
        blocks="model.layers",
        sequential=(_QKV + ("mlp.gate_proj", "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj")),
        scale_groups=(("input_layernorm", _QKV + ("mlp.gate_proj", "mlp.up_proj")),
                      ("self_attn.v_proj", ("self_attn.o_proj",)), ("mlp.up_proj", ("mlp.down_proj",))),
        reusable=(("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj")),
        fused=_LLAMA_FUSED,
    ),
    "starcoder2": _one_mlp_input("mlp.c_fc", "mlp.c_proj"),
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


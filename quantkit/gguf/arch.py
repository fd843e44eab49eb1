"""What llama.cpp calls a transformers model's parts: architecture, hyperparameter keys and tensor names, as data.

A GGUF file names its tensors and hyperparameters as llama.cpp's convert_hf_to_gguf.py does (its model classes and
gguf-py's tensor map): "model.layers.3.self_attn.q_proj.weight" is "blk.3.attn_q.weight", hidden_size is
"llama.embedding_length". One more difference is in the weights themselves: llama.cpp's "llama" architecture
applies rotary embeddings to interleaved pairs (x0, x1), (x2, x3) ... where transformers rotates the two halves of
each head, so q_proj's and k_proj's rows are reordered per head (`rotary_rows`). Only rows move: a quantized row
keeps its blocks, so the reordering is exact on packed codes too.
"""
import re
from dataclasses import dataclass

import torch

from quantkit.core.errors import QuantkitError


@dataclass(frozen=True)
class GGUFArch:
    name: str               # general.architecture
    permute_qk: bool        # q/k rows reordered for llama.cpp's interleaved rotary (llama); neox-style archs keep them


ARCHS = {"llama": GGUFArch("llama", True), "mistral": GGUFArch("llama", True),
         "qwen2": GGUFArch("qwen2", False), "qwen3": GGUFArch("qwen3", False)}

TOP_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
BLOCK_PREFIX = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
BLOCK_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.down_proj.bias": "ffn_down.bias",
}
GGUF_NAMES = {gguf: hf for hf, gguf in BLOCK_TENSORS.items()}

# {GGUF key under the architecture: (config.json fields tried in order, value type)}; "u32" / "f32"
HPARAMS = {
    "context_length": (("max_position_embeddings",), "u32"),
    "embedding_length": (("hidden_size",), "u32"),
    "block_count": (("num_hidden_layers",), "u32"),
    "feed_forward_length": (("intermediate_size",), "u32"),
    "attention.head_count": (("num_attention_heads",), "u32"),
    "attention.head_count_kv": (("num_key_value_heads", "num_attention_heads"), "u32"),
    "attention.layer_norm_rms_epsilon": (("rms_norm_eps",), "f32"),
    "vocab_size": (("vocab_size",), "u32"),
}


def arch_of(config: dict) -> GGUFArch:
    """The llama.cpp architecture of a config.json (dict), or a QuantkitError naming the ones written."""
    model_type = config.get("model_type")
    if model_type not in ARCHS:
        raise QuantkitError(f"--checkpoint-format gguf writes {', '.join(sorted(ARCHS))} models; this one is "
                            f"{model_type!r}: write it in another format (gptq, awq, compressed-tensors)")
    rope = rope_settings(config)
    if rope.get("rope_type", "default") not in ("default", "linear"):
        raise QuantkitError(f"--checkpoint-format gguf does not write {rope['rope_type']!r} rope scaling yet: write "
                            "this model in another format (gptq, awq, compressed-tensors)")
    return ARCHS[model_type]


def rope_settings(config: dict) -> dict:
    """rope_theta and the scaling, where transformers 5 keeps them (rope_parameters) or older configs did."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    if "rope_theta" not in rope and "rope_theta" in config:
        rope["rope_theta"] = config["rope_theta"]
    return rope


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def gguf_name(name: str) -> str | None:
    """The GGUF name of a transformers tensor name; None for one llama.cpp does not read (rotary buffers)."""
    if name in TOP_TENSORS:
        return TOP_TENSORS[name]
    m = BLOCK_PREFIX.match(name)
    if m and m.group(2) in BLOCK_TENSORS:
        return f"blk.{m.group(1)}.{BLOCK_TENSORS[m.group(2)]}"
    return None


def hf_name(name: str) -> str:
    """The transformers name of a GGUF tensor name (gguf_name's inverse)."""
    for hf, gguf in TOP_TENSORS.items():
        if name == gguf:
            return hf
    block, _, leaf = name.removeprefix("blk.").partition(".")
    if name.startswith("blk.") and leaf in GGUF_NAMES:
        return f"model.layers.{block}.{GGUF_NAMES[leaf]}"
    raise QuantkitError(f"GGUF tensor {name} has no transformers name known to quantkit")


def rotary_heads(name: str, config: dict) -> int | None:
    """How many heads a q or k projection's rows hold, when llama.cpp wants them reordered (else None)."""
    if not ARCHS[config["model_type"]].permute_qk:
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return config["num_attention_heads"]
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.get("num_key_value_heads") or config["num_attention_heads"]
    return None


def rotary_rows(rows: int, heads: int, inverse: bool = False) -> torch.Tensor:
    """The row order llama.cpp wants for a q/k projection of `heads` heads: within each head, the first half's row i
    goes to 2i and the second half's to 2i + 1 (stored = original[order]); inverse gives the order back."""
    half = rows // heads // 2
    order = torch.arange(rows).view(heads, 2, half).transpose(1, 2).reshape(-1)
    return torch.argsort(order) if inverse else order

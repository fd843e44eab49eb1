"""Tiny random models built from configs, saved as HF folders with the bundled tokenizer (vocab 512)."""
from pathlib import Path

import torch
from transformers import AutoTokenizer

from quantkit.demo import bundled_model_path

VOCAB = 512


def _llama(kv_heads=2, tie=False, bias=False, layers=2, hidden=64, intermediate=96):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias)


def _opt():
    from transformers import OPTConfig

    return OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=144, num_hidden_layers=2, num_attention_heads=4,
                     word_embed_proj_dim=64, max_position_embeddings=256)


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)


def _mixtral():
    """transformers 5 holds the experts as fused 3-D tensors (gate_up_proj, down_proj) and saves them per expert."""
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         num_local_experts=4, num_experts_per_tok=2)


CONFIGS = {
    "llama": lambda: _llama(kv_heads=4),
    "llama-gqa": lambda: _llama(kv_heads=2),
    "llama-tied-bias": lambda: _llama(kv_heads=2, tie=True, bias=True),
    "llama-deep": lambda: _llama(kv_heads=2, bias=True, layers=4),
    # rows of whole k-quant super-blocks (256), but ffn_down's 288 inputs are not: llama.cpp's fallbacks
    "llama-256": lambda: _llama(kv_heads=2, hidden=256, intermediate=288),
    "opt": _opt,
    "gpt2": _gpt2,
    "mixtral": _mixtral,
}


def make_model_folder(kind: str, root: Path, dtype=torch.float32, seed=0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=dtype)
    folder = Path(root) / kind
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    return folder


def dequantize_gptq(t: dict, bits: int, in_features: int, checkpoint_format: str = "gptq") -> torch.Tensor:
    """Full float32 weight [N, K] (nn.Linear orientation) of one layer's GPTQ-layout tensors."""
    from quantkit.core.gptq_layout import V1_ZERO_OFFSET, decode

    w_t = decode(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, in_features,
                 V1_ZERO_OFFSET[checkpoint_format])
    return w_t.t().contiguous()


def run_sequential(model, arch, input_ids, method, device, true_sequential=True, store_device="cpu") -> dict:
    """Quantize every block of an in-memory model in order; {full module name: QuantResult}."""
    from quantkit.calibration.sequential import calibrated_blocks
    from quantkit.models.stream import InMemoryModel

    results = {}
    for _, _, block_results in calibrated_blocks(InMemoryModel(model, ""), arch, input_ids, method, device,
                                                 true_sequential, store_device):
        results.update(block_results)
    return results


def model_tensors(state_dict: dict, results: dict, codec, config) -> dict:
    """A whole checkpoint's tensors, as quantkit wrote them before streaming: the codec's for quantized modules,
    everything else as it is."""
    out = {name: t for name, t in state_dict.items()
           if not (name.rpartition(".")[0] in results and name.rpartition(".")[2] in ("weight", "bias"))}
    for module, res in results.items():
        bias = state_dict.get(f"{module}.bias")
        for suffix, t in codec.layer_tensors(res, config, bias.dtype if bias is not None else None).items():
            out[f"{module}.{suffix}"] = t
    return out


def save_random(cfg, folder: Path) -> Path:
    """A random model of config `cfg` saved in `folder` with the bundled tokenizer; weights from_config leaves at
    zero (some expert tensors) drawn from N(0, 0.02)."""
    from quantkit.models.hub import model_class

    torch.manual_seed(0)
    model = model_class(cfg).from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1 and not p.abs().sum():
                p.normal_(0, 0.02)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    return folder

"""Tiny random models built from configs, saved as HF folders with the bundled tokenizer (vocab 512)."""
from pathlib import Path

import torch
from transformers import AutoTokenizer

from quantkit.demo import bundled_model_path

VOCAB = 512


def _llama(kv_heads=2, tie=False, bias=False, layers=2):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias)


def _opt():
    from transformers import OPTConfig

    return OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=144, num_hidden_layers=2, num_attention_heads=4,
                     word_embed_proj_dim=64, max_position_embeddings=256)


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)


CONFIGS = {
    "llama": lambda: _llama(kv_heads=4),
    "llama-gqa": lambda: _llama(kv_heads=2),
    "llama-tied-bias": lambda: _llama(kv_heads=2, tie=True, bias=True),
    "llama-deep": lambda: _llama(kv_heads=2, bias=True, layers=4),
    "opt": _opt,
    "gpt2": _gpt2,
}


def make_model_folder(kind: str, root: Path, dtype=torch.float32, seed=0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=dtype)
    folder = Path(root) / kind
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    return folder

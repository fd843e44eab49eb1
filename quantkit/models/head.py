"""The model's head: the final norm after the last decoder block and the output projection (lm_head) it feeds.

Quantizing lm_head (--lm-head) calibrates it on what it really reads, the final norm of the last block's outputs,
so the loop needs both. transformers' get_output_embeddings() names lm_head; the final norm is a child of the
language model's decoder under one of the names below (architecture knowledge as data).
"""
from dataclasses import dataclass

from torch import nn

from quantkit.core.errors import QuantkitError
from quantkit.models.arch import decoder_path, is_linear

# the decoder's final norm, as transformers' families name it: Llama/Mistral/Qwen/Gemma/DeepSeek, GPT-2/BLOOM,
# OPT, Phi
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm")


@dataclass(frozen=True)
class HeadPaths:
    """Dotted paths from the CausalLM: lm_head (the output projection) and the final norm feeding it; tied: lm_head's
    weight is the input embedding's (stored once, under `embedding`)."""
    lm_head: str
    norm: str
    embedding: str
    tied: bool


class Head(nn.Module):
    """The final norm then lm_head, as one module the calibration loop forwards like a block."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden_states, **kwargs):
        return self.lm_head(self.norm(hidden_states))


def head_paths(model: nn.Module) -> HeadPaths:
    """Where the head is, or a QuantkitError saying why lm_head cannot be quantized for this model."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {id(m): n for n, m in model.named_modules()}
    if head is None or not is_linear(head) or id(head) not in names:
        raise QuantkitError(f"{type(model).__name__} has no linear output projection (get_output_embeddings): "
                            "--lm-head cannot quantize it; drop --lm-head")
    root = decoder_path(model)
    norm = next((f"{root}.{n}" if root else n for n in FINAL_NORMS
                 if isinstance(getattr(model.get_submodule(root), n, None), nn.Module)), None)
    if norm is None:
        raise QuantkitError(f"the final norm of {type(model).__name__} is none of {', '.join(FINAL_NORMS)} under "
                            f"'{root or 'the model'}': --lm-head needs it to calibrate lm_head; add its name to "
                            "quantkit/models/head.py or drop --lm-head")
    embedding = model.get_input_embeddings()
    return HeadPaths(lm_head=names[id(head)], norm=norm, embedding=f"{names[id(embedding)]}.weight",
                     tied=head.weight is embedding.weight)


def tied_head(model: nn.Module):
    """(output projection, input embedding) when the head reuses the embedding's weight (the config says so, or they
    are one tensor: a streamed source's loads may have parted them), else None."""
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model class without them (transformers' base raises)
        return None
    if head is None or embedding is None:
        return None
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False) or head.weight is embedding.weight
    return (head, embedding) if tied and tuple(head.weight.shape) == tuple(embedding.weight.shape) else None


def untie(model_config: dict) -> None:
    """config.json (as a dict) of a checkpoint whose lm_head is quantized: its weights are no longer the embedding's
    (a vision-language model's text config says so too)."""
    for config in (model_config, model_config.get("text_config")):
        if isinstance(config, dict):
            config["tie_word_embeddings"] = False

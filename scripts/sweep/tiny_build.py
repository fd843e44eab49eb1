"""tiny_config and build_tiny: a family's default config shrunk (sweep.shrink) and cut to the fewest layers
(sweep.layers), then built with random weights, filled where from_config leaves parameters empty, and checked
to run (and, for a text-only family, to be causal)."""
import re
from pathlib import Path

from sweep.common import auto_class, config_class, one_line, quiet, without_cache
from sweep.layers import cut_layers, layer_count_field
from sweep.shrink import (BOS, construct, fitted_mrope_sections, match_text_width, merged, shrink_dict,
                          table_values_for_unset, undeclared)

FORWARD_IDS = [[BOS] + [(7 * i + 3) % 400 + 3 for i in range(31)]]  # no special or image token among them

# Defaults that transformers leaves unusable and that no generic rule can supply, as data: model_type -> fields
# merged into the shrunk config dict (sub-configs as nested dicts). Each entry says why no rule does it.
MISSING_DEFAULTS = {
    # Lfm2MoeConfig defaults layer_types to None, which its model indexes layer by layer (Lfm2Config derives it from
    # full_attn_idxs; the MoE config has no such field). LFM2-8B-A1B's kind of pattern: short convolutions with
    # an attention layer every few.
    "lfm2_moe": {"layer_types": ["full_attention" if i % 4 == 2 else "conv" for i in range(32)]},
    # Apertus 1.5 lays its image and audio codebooks out in the vocabulary after the text ids (checked:
    # image_token_offset + vision codebook_size == audio_token_offset, + audio codebook_size <= vocab_size), so the
    # default codebooks keep a 266752-id vocabulary. The same layout in the small one: 256 text ids, 2 x 64 codes.
    "apertus1p5": {"image_token_offset": 256, "audio_token_offset": 320, "vision_config": {"codebook_size": 64},
                   "audio_config": {"codebook_size": 64}},
    # Chameleon's model maps image codes to BPE ids through vocabulary_map, which the default leaves None (the
    # released checkpoints carry the tokenizer's map, "<image>": 8711 among 65536 ids). A small map: the image
    # placeholder and a few image codes inside the shrunk vocabulary.
    "chameleon": {"vocabulary_map": {"<image>": 300, **{f"IMGIMG{chr(65 + i)}Z": 301 + i for i in range(8)}}},
    # Cohere Compass's rotary module looks rope_parameters up per layer type, but the default is {} (the released
    # configs key it by layer type). Cohere 2's layout: three sliding layers with RoPE, then a full layer without.
    "cohere_compass": {"text_config": {
        "layer_types": ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(40)],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 50000.0},
                            "full_attention": None}}},
    "cohere_compass_text": {
        "layer_types": ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(40)],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 50000.0},
                            "full_attention": None}},
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig's default leaves out, and clamps q, k
    # and v to clip_qkv, None by default (DBRX's released config sets 500000 and 8).
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # DeepSeek-OCR 2's decoder layers index mlp_layer_types, None by default; the DeepSeek-V2 layout of its
    # release: the first layer dense, the rest mixture-of-experts.
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense"] + ["sparse"] * 31}},
    # Granite 4 Vision builds one projector per deepstack_layer_map entry, and each parses downsample_rate: both
    # None by default. Pairs of (vision layer, decoder layer) like the release's, the last vision layers into the
    # first decoder layers; the docstring's "1/4" rate.
    "granite4_vision": {"deepstack_layer_map": [[-1, 0], [-2, 1]], "downsample_rate": "1/4"},
    # Qwen4-Exp's indexed-attention layers build the QSA indexer from the indexer_* fields, None by default (the
    # released config sets them; the indexer takes one key head). Budget and block small enough to select among
    # the sweep's 32-token prompts.
    "qwen4_exp": {"text_config": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 32,
                                  "indexer_budget": 16, "indexer_compress_ratio": 4}},
    # BLT is byte-level (256 bytes and 4 specials: vocab_size 260), but the sweep calibrates and evaluates with the
    # bundled tokenizer, whose ids reach 511: a random model needs no byte meaning, only embeddings for every id.
    # Set in each component that embeds or predicts ids (the patcher, local encoder and decoder, and the head).
    "blt": {"vocab_size": 512, "patcher_config": {"vocab_size": 512}, "encoder_config": {"vocab_size": 512},
            "decoder_config": {"vocab_size": 512}},
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 32,
                       "indexer_budget": 16, "indexer_compress_ratio": 4},
}


def tiny_config(model_type: str, overrides: dict | None = None, prefix: bool = False, per_kind: int = 1,
                rederive: bool = False):
    """A small config of the family: the class's defaults shrunk by SHRINK, then cut to the fewest layers that still
    hold every kind of layer of the default (cut_layers). Consistency checks that the shrunk values fail are met
    by construct's generic repairs. overrides: values set in the text decoder's shrunk fields; prefix: keep the
    shortest prefix of layers holding every kind; per_kind: layers kept of each kind; rederive: leave out the text
    decoder's fields its class derives (build_tiny's retries, for checks only the model makes)."""
    cls, base, small, key = _shrunk(model_type)
    text = small[key] if key else small
    if rederive:
        text = {k: v for k, v in text.items() if k not in undeclared(config_class(text.get("model_type")) or cls, text)}
    text = {**text, **(overrides or {})}
    small = {**small, key: text} if key else text
    config, small = construct(cls, small, base, key)
    text_dict = small.get(key) if key else small
    count = layer_count_field(getattr(config, key) if key else config)
    if not isinstance(text_dict, dict) or count is None or not isinstance(text_dict.get(count), int):
        return config  # no layer count to cut (pi0, blt): widths only
    return cut_layers(cls, config, small, key, base, count, prefix, per_kind)


def _shrunk(model_type: str) -> tuple:
    """(config class, its default's dict, that dict shrunk, the text decoder's sub-config key or None)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = quiet(cls)
    key = _text_key(default)
    base = default.to_dict()
    small = match_text_width(shrink_dict(base, set(cls.sub_configs), key, cls), base, key)
    return cls, base, merged(small, MISSING_DEFAULTS.get(model_type, {})), key


def _text_key(config) -> str | None:
    """The sub-config key of the text decoder (None: the config is the text decoder)."""
    text = config.get_text_config(decoder=True)
    return next((k for k in config.sub_configs if getattr(config, k, None) is text), None)


class NotADecoder(Exception):
    """The family's tiny model is not causal: an earlier position's logits depend on a later token."""


class NotBuilt(Exception):
    """No attempt built a working tiny model; the message is the first attempt's error."""


def build_tiny(model_type: str, folder, dtype=None, seed: int = 0) -> Path:
    """A tiny random model of the family saved in `folder` (with the bundled tokenizer); returns the folder.
    Parameters from_config left all zero or never initialised get N(0, 0.02), so that every linear the sweep
    quantizes carries signal. A text-only family must be causal (else NotADecoder: an encoder with a causal-LM
    head); image-text ones may attend both ways over the prompt (PaliGemma's prefix). Where the model refuses
    the tiny config (a check in its code, a shape its code fixes), _attempts' generic retries follow."""
    import torch
    from transformers import AutoTokenizer

    from quantkit.demo import bundled_model_path

    first_error = None
    for label, kwargs in _attempts(model_type):
        try:
            model = _tiny_model(model_type, tiny_config(model_type, **kwargs), seed)
            break
        except NotADecoder:
            raise
        except Exception as e:  # noqa: BLE001 (the next attempt, or the first error in the end)
            first_error = first_error or e
    else:
        raise NotBuilt(one_line(first_error) + _default_fails(model_type, first_error)) from first_error
    model.to(dtype or torch.bfloat16)
    model.config.family_sweep_repair = label  # saved in config.json: how the build got through
    quiet(model.save_pretrained, folder)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    return Path(folder)


def _tiny_model(model_type: str, config, seed: int):
    """The model of `config`, filled and checked (see build_tiny)."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    _check_size(config)
    torch.manual_seed(seed)
    model = quiet(auto_class(config).from_config, config, dtype=torch.float32).eval()
    _fill_uninitialised(model, torch.Generator().manual_seed(seed))
    model.to(torch.bfloat16).float()  # the check sees the weights as saved
    _check_forward(model, causal=model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return model


def _attempts(model_type: str, reverts: int = 8):
    """(label, tiny_config arguments) to try in turn, each a generic fix of what the model's code (not the config's
    checks, which construct meets) refuses in the tiny config:
    - as shrunk;
    - the head widths at their defaults, with as few heads as the width leaves (code that hard-codes rotary sections
      for the default width: Qwen2-VL's);
    - multimodal RoPE sections fitted to the shrunk rotary width, where the code hard-codes sections that fit no
      width of the default config (GLM-4V's [8, 12, 12], whose default config has no partial rotary factor);
    - the fields __post_init__ derives (those the class does not declare) left out, for it to derive them from the
      shrunk and cut fields: passed in, they override its derivation (Zamba2's attention_hidden_size);
    - the layers as a prefix;
    - two layers of each kind (Zamba's shared transformer block is tied from its first hybrid layer into the later
      ones: with one hybrid layer the tie has no target);
    - the table's values for fields the default leaves None (Step3p7's code builds a sliding-window mask whether or
      not any layer slides; dots1's default has no experts);
    - one shrunk field of the text decoder at a time back at its default, the smallest first."""
    yield "", {}
    try:
        cls, base, small, key = _shrunk(model_type)
    except Exception:  # noqa: BLE001 (the default config itself fails: the first attempt's error says why)
        return
    text_class = config_class(small[key].get("model_type")) if key else cls
    base, small = (base.get(key, {}), small.get(key, {})) if key else (base, small)
    widths = _default_head_widths(base, small)
    if widths:
        yield "head widths at their defaults", {"overrides": widths}
    sections = fitted_mrope_sections(small, text_class)
    if sections:
        rope = {**small["rope_parameters"], "mrope_section": sections}
        yield f"mrope_section {sections}", {"overrides": {"rope_parameters": rope}}
    derived = undeclared(text_class, small)
    if derived:
        yield f"{', '.join(derived)} left to __post_init__", {"rederive": True}
    yield "layers as a prefix", {"prefix": True}
    yield "two layers of each kind", {"per_kind": 2}
    unset = table_values_for_unset(small)
    if unset:
        yield f"{', '.join(unset)} set (None by default)", {"overrides": unset}
    changed = sorted((v, k) for k, v in base.items() if isinstance(v, int) and not isinstance(v, bool)
                     and isinstance(small.get(k), int) and small[k] != v and not k.endswith("_token_id"))
    for value, field in changed[:reverts]:
        yield f"{field} at its default ({value})", {"overrides": {field: value}}


def _default_head_widths(base: dict, small: dict) -> dict:
    """The text decoder's head widths at their defaults, with as many heads as the shrunk width holds."""
    heads, hidden = base.get("num_attention_heads"), base.get("hidden_size")
    widths = {k: v for k, v in base.items() if k.endswith("head_dim") and isinstance(v, int)}
    if isinstance(heads, int) and isinstance(hidden, int) and isinstance(small.get("hidden_size"), int):
        width = widths.setdefault("head_dim", hidden // heads)
        widths["num_attention_heads"] = max(1, small["hidden_size"] // width)
        for kv in [k for k in small if re.search(r"(key_value|kv)_heads$", k) and isinstance(small[k], int)]:
            widths[kv] = min(small[kv], widths["num_attention_heads"])
    return widths


def _default_fails(model_type: str, error: Exception) -> str:
    """' (the default config fails too[: why])' when the family's own default config cannot build its model either
    (its reason left out where it is the tiny config's)."""
    import torch
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = quiet(CONFIG_MAPPING[model_type])
        with torch.device("meta"):
            quiet(auto_class(config).from_config, config)
    except Exception as e:  # noqa: BLE001
        why = one_line(e)
        return " (the default config fails too)" if why == one_line(error) else (
            f" (the default config fails too: {why[:120]})")
    return ""


def _check_size(config, limit: int = 200_000_000) -> None:
    """Refuses a config the table left big (a field it does not know), naming the largest parameters. A timm tower
    (Gemma 3n's MobileNetV5) is left out of the count: its config names an architecture, whose size no field sets."""
    import torch

    with torch.device("meta"):
        model = quiet(auto_class(config).from_config, config)
    sizes = sorted(((p.numel(), n) for n, p in model.named_parameters() if ".timm_model." not in n), reverse=True)
    total = sum(n for n, _ in sizes)
    if total > limit:
        raise ValueError(f"{total / 1e6:.0f}M parameters after shrinking; largest: "
                         + ", ".join(f"{n} {size / 1e6:.0f}M" for size, n in sizes[:3]))


def _fill_uninitialised(model, generator) -> None:
    """N(0, 0.02) into each floating parameter that is all zero, or holds what uninitialised memory holds
    (non-finite, huge or denormal values)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point() or p.numel() == 0:
                continue
            peak = p.detach().abs().max().item()
            if peak == 0 or not torch.isfinite(p).all() or peak > 1e4 or peak < 1e-30:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)


def _check_forward(model, causal: bool) -> None:
    """The fp model runs on FORWARD_IDS with finite logits; causal: changing the last token leaves every earlier
    position's logits alone."""
    import torch

    ids = torch.tensor(FORWARD_IDS)
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % 400 + 3
    kwargs = without_cache(model)
    with torch.inference_mode():
        a = model(input_ids=ids, **kwargs).logits[:, :-1]
        if not torch.isfinite(a).all():
            raise ValueError("the fp model's logits are not finite")
        if causal and not torch.allclose(a, model(input_ids=other, **kwargs).logits[:, :-1], rtol=1e-4, atol=1e-5):
            raise NotADecoder("not causal (logits of earlier positions depend on later tokens): not a decoder")

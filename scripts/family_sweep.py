#!/usr/bin/env python
"""Every decoder family transformers ships, quantized by quantkit: which ones it handles, and how well.

For each family (a model_type of transformers' causal-LM or image-text-to-text table, encoder-decoders and
masked-LM encoders aside) a tiny random model is built from the family's own config class, its defaults shrunk
by one table of field names (no entry per family), with the fewest layers that still hold every kind of layer
the full default config has. Each method then runs in a child process of its own, so a crash or a hang costs
one row: `quantkit quantize` (the CLI, calibrating on a local text file), load_quantized of the output and one
forward on fixed token ids, compared with the fp model's logits. The quantized share is counted again here from
the output's safetensors files, independently of the share quantkit prints.

    python scripts/family_sweep.py --families llama qwen3_next gemma4 --workdir /tmp/sweep
    python scripts/family_sweep.py --timeout 240 --out docs/MODELS.md   (every family, rtn and gptq)
    git archive REV quantkit | tar -x -C /tmp/qk && PYTHONPATH=/tmp/qk python scripts/family_sweep.py ...
        (the children run another quantkit tree: a fixed revision while the working tree changes)
"""
import argparse
import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import time
import warnings
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CALIB = REPO.parent / "shared" / "assets" / "text" / "wikitext2_tok_valid.txt"
MAX_LAYERS = 6
ROW = "row: "  # the prefix of a finished family's row (JSON) on stdout
PAD, BOS, EOS = 0, 1, 2  # the bundled stories260k tokenizer's
VOCAB = 512
FORWARD_IDS = [[BOS] + [(7 * i + 3) % 400 + 3 for i in range(31)]]  # no special or image token among them
ANSWER = "family_sweep> "  # a child's JSON answer is the stdout line that starts so
MARKER = ".family_sweep"  # marks a workdir/<family> folder this script made (and may delete)

EXPERTS = r"(^|_)(num_local_experts|num_experts|n_routed_experts|moe_num_experts|num_routed_experts|n_experts)$"
# (field-name pattern, value it shrinks to): first match wins; an int field is lowered to the value, never raised;
# None (a feature turned off) stays None. Applies to the config and to every nested sub-config alike.
SHRINK = [
    (r"vocab_size", VOCAB),
    (r"^q_lora_rank$", 32),
    (r"lora_rank$", 16),
    (r"qk_rope_head_dim$", 16),
    (r"qk_nope_head_dim$", 16),
    (r"head_dim$|^kv_channels$|^d_head$|head_size$", 32),
    (r"rotary_dim$", 16),
    (r"(moe|expert).*(intermediate|ffn|hidden)_size|(intermediate|ffn)_size.*(moe|expert)", 64),
    (r"_per_layer_input$", 32),
    (r"intermediate_size|^ffn_dim$|^n_inner$|ffn_hidden_size|^mlp_dim$|^d_ff$|^ff_dim$|^d_inner$", 256),
    (r"hidden_size$|^(n_embd|d_model|dim|embed_dim|embedding_dim|model_dim|hidden_dim|projection_dim)$", 128),
    (r"(key_value|kv)_heads|^multi_query_group_num$|^n_head_kv$|^num_kv$|linear_num_key_heads$", 2),
    (r"(^|_)(n_head|n_heads|num_heads)$|num_.*heads$|attention_heads$", 4),
    (r"n_groups$", 1),
    (EXPERTS, 4),
    (r"shared_experts$", 1),
    (r"experts_per_tok|^moe_topk$|^moe_top_k$|^moe_k$|^num_experts_per_token$|^top_k_experts$", 2),
    (r"^(n_group|topk_group|num_group|num_expert_group|topk_expert_group)$", 1),
    (r"max_position_embeddings|^n_positions$|^n_ctx$|^max_seq_len$", 256),
    (r"sliding_window$|^attention_window$", 32),
    (r"^first_k_dense_replace$|^num_dense_layers$", 1),
]
LAYER_LIST_INDEX = re.compile(r"idx|index|indices|indexes|_layers$")  # lists of layer numbers, not one per layer
TOWER = re.compile(r"vision|visual|video|audio|image|vq|perceiver|qformer|projector|patch|speech|protein|mtp")


def decoder_families() -> list:
    """model_types transformers builds a text-generating head for, less encoder-decoders and the BERT-style encoders
    that also register a causal-LM head (their masked-LM head is what they are); a family that is still not causal
    is caught by build_tiny's causality check."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    keys = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return sorted(t for t in keys - set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)
                  if not _encoder_decoder(CONFIG_MAPPING[t]))


def _encoder_decoder(config_class) -> bool:
    """The class's default is_encoder_decoder, or an encoder/decoder pair of sub-configs (T5Gemma2, Musicgen)."""
    default = next((f.default for f in dataclasses.fields(config_class) if f.name == "is_encoder_decoder"), False)
    return bool(default) or {"encoder", "decoder"} <= set(config_class.sub_configs) or (
        "text_encoder" in config_class.sub_configs)


def auto_class(config):
    """AutoModelForCausalLM where it takes this config class, else AutoModelForImageTextToText (Emu3's and
    Mllama's causal-LM entries take their text config only)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModelForImageTextToText


# --- tiny configs -----------------------------------------------------------------------------------------------

def _shrink_value(name: str, value):
    """The table's value for field `name` (ints lowered only; lists of sizes shrunk element by element)."""
    for pattern, small in SHRINK:
        if re.search(pattern, name):
            if isinstance(value, bool) or value is None:
                return value
            if isinstance(value, int):
                return min(value, small)
            if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                         for v in value):
                return [min(v, small) for v in value]
            return value
    return value


def _token_ids(d: dict) -> None:
    """Special token ids inside the small vocabulary: pad/bos/eos the bundled tokenizer's, any other special token
    (image, audio, ...) one of the top ids, which the forward's ids never use."""
    spare = iter(range(VOCAB - 1, 402, -1))
    fixed = {"pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS, "decoder_start_token_id": BOS}
    for key in sorted(d):
        value = d[key]
        if not key.endswith("_token_id") and not key.endswith("_token_index"):
            continue
        if key in fixed and value is not None:
            d[key] = [fixed[key]] if isinstance(value, list) else fixed[key]
        elif isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            d[key] = next(spare)
        elif isinstance(value, list):
            d[key] = [v if v < VOCAB else next(spare) for v in value if isinstance(v, int)]


def _shrink_dict(d: dict, sub_keys: set, text_key: str | None = None, cls=None) -> dict:
    """The table applied to a config's dict and, recursively, to its sub-configs' dicts (vision and audio towers
    keep their layer count: they are cheap at these widths, and their layer-indexed fields stay valid). Scalars
    the class (the top config's, and the text decoder's) derives in __post_init__ are left out, to be derived
    again from the shrunk fields."""
    out = {}
    derived = _derived(cls, d)
    for key, value in d.items():
        if key in derived:
            continue
        if isinstance(value, dict) and (key in sub_keys or "model_type" in value):
            value = _shrink_dict(value, set(), cls=_config_class(value.get("model_type")) if key == text_key else None)
        elif key == "per_layer_config" and isinstance(value, dict):
            value = {i: _shrink_dict(entry, set()) for i, entry in value.items()}
        else:
            value = _shrink_value(key, value)
        out[key] = value
    _token_ids(out)
    _keep_equal_heads(d, out)
    _keep_equal_head_dims(d, out)
    _scale_rope_sections(d, out)
    _fill_head_dim(out)
    _fill_experts_per_token(out)
    return out


def _fill_head_dim(d: dict) -> None:
    """head_dim = hidden / heads where the field is None: some families' modeling code does not derive it."""
    heads, hidden = d.get("num_attention_heads"), d.get("hidden_size")
    if "head_dim" in d and d["head_dim"] is None and isinstance(heads, int) and isinstance(hidden, int):
        d["head_dim"] = hidden // heads


def _fill_experts_per_token(d: dict) -> None:
    """Experts per token 2 where the field is None beside a number of experts (DeepSeek-V2's default)."""
    experts = [k for k, v in d.items() if isinstance(v, int) and re.search(EXPERTS, k)]
    for key in [k for k, v in d.items() if v is None and re.search(r"experts_per_tok", k)]:
        if experts:
            d[key] = 2


def _config_class(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None


def _derived(cls, d: dict) -> set:
    """Scalar fields that cls declares `= None` but d holds a value for: derived by __post_init__ (Zamba2's
    attention_head_dim = 2 x hidden / heads) and to be derived again, not carried over at their default's value.
    Token ids aside (the small vocabulary's are set here)."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls) if f.default is None and f.name in d and not f.name.endswith(
        "_token_id") and d[f.name] is not None and isinstance(d[f.name], (int, float, str)) and f.name != "dtype"}


def _keep_equal_heads(before: dict, after: dict) -> None:
    """A family without grouped-query attention (key/value heads = heads by default) keeps it."""
    for kv in [k for k in after if re.search(r"(key_value|kv)_heads$", k)]:
        heads = kv.replace("key_value", "attention").replace("kv_heads", "heads")
        if heads in before and before[heads] == before[kv] and isinstance(after.get(heads), int):
            after[kv] = after[heads]
        elif heads in before and before[kv] is None and isinstance(after.get(heads), int):
            after[kv] = after[heads]  # None: as many as the heads, which some families do not derive


def _keep_equal_head_dims(before: dict, after: dict) -> None:
    """Head widths equal by default (DeepSeek's head_dim = qk_rope_head_dim, v_head_dim = qk_nope_head_dim) stay
    equal, at the smaller shrunk value."""
    dims = [k for k, v in after.items()
            if k.endswith("head_dim") and isinstance(v, int) and isinstance(before.get(k), int)]
    for a in dims:
        for b in dims:
            if a < b and before[a] == before[b] and after[a] != after[b]:
                after[a] = after[b] = min(after[a], after[b])


def _rope_dim(d: dict):
    for key in ("qk_rope_head_dim", "head_dim"):
        if isinstance(d.get(key), int):
            return d[key]
    heads = d.get("num_attention_heads")
    return d["hidden_size"] // heads if isinstance(heads, int) and isinstance(d.get("hidden_size"), int) else None


def _scale_rope_sections(before: dict, after: dict) -> None:
    """Multimodal RoPE sections (mrope_section: how the rotary dims split over time/height/width) shrunk with the
    head width, their sum kept at the same share of it."""
    old, new = _rope_dim(before), _rope_dim(after)
    rope = after.get("rope_parameters")
    if not (old and new and isinstance(rope, dict)):
        return
    for params in [rope, *[v for v in rope.values() if isinstance(v, dict)]]:
        sections = params.get("mrope_section")
        if isinstance(sections, list) and sections and old != new:
            scaled = [max(1, s * new // old) for s in sections]
            scaled[0] += sum(sections) * new // old - sum(scaled)
            params["mrope_section"] = scaled


def _match_text_width(d: dict, default: dict, text_key: str | None) -> dict:
    """Towers' fields naming the text decoder's width (out_hidden_size, text_hidden_size, ...: a *hidden_size* field
    equal to it by default) follow the text decoder's new width."""
    if not text_key or not isinstance(d.get(text_key), dict):
        return d
    old, new = default[text_key].get("hidden_size"), d[text_key].get("hidden_size")
    out = dict(d)
    for key, sub in d.items():
        if key != text_key and isinstance(sub, dict) and "model_type" in sub and isinstance(default.get(key), dict):
            out[key] = {k: new if "hidden_size" in k and default[key].get(k) == old and k != "hidden_size" else v
                        for k, v in sub.items()}
    return out


def _layer_signatures(config, key: str | None, like: tuple | None = None) -> list:
    """One hashable description per layer of the text decoder (config.<key>, or config itself): its entries in the
    per-layer fields (layer_types, mlp_layer_types, hybrid patterns, masks, per_layer_config), its membership of
    index lists (mlp_only_layers, full_attn_idxs) and of layer-count partitions (n_input_layers + n_recurrent_layers
    + ...), and the names and shapes of its parameters in a meta-device build of the whole model (which catches
    patterns only the modeling code knows: decoder_sparse_step, attn_layer_period, moe_layer_freq). like: the
    full config's _layer_fields, to read a cut config's fields as the full config's were read."""
    text = getattr(config, key) if key else config
    d = text.to_dict()
    n = d[_layer_count_field(text)]
    per_layer, index_lists, parts, _ = _layer_fields(d, n, like)
    segment = [k for k, size in parts.items() for _ in range(size)]
    sigs = [tuple((k, v[i]) for k, v in per_layer.items()) + tuple((k, i in v) for k, v in index_lists.items())
            + ((segment[i],) if segment else ()) for i in range(n)]
    shapes = _meta_layer_shapes(config, n)
    return [s + shapes[i] for i, s in enumerate(sigs)] if shapes else sigs


def _layer_count_field(config) -> str | None:
    """The field holding the number of layers: num_hidden_layers, what attribute_map maps it to, or num_layers
    (a family whose num_hidden_layers is a property); None if the config stores none."""
    d = config.to_dict()
    return next((k for k in (config.attribute_map.get("num_hidden_layers"), "num_hidden_layers", "num_layers",
                             "n_layer", "n_layers") if isinstance(d.get(k), int) and not isinstance(d[k], bool)), None)


def _layer_fields(d: dict, n: int, like: tuple | None = None) -> tuple:
    """Of a config dict with n layers: ({field: one entry per layer}, {field: set of layer numbers}, {field: size of
    a partition of the layers into consecutive runs}, {field: a count of layers below n (num_kv_shared_layers)}).
    like: another config's answer, whose fields are read the same way here (a cut config's 2-entry list of layer
    numbers would otherwise pass for a per-layer mask)."""
    if like is not None:
        per_layer, index_lists, parts, counts = (
            {k: _per_layer(d[k], n) if k == "per_layer_config" else d[k] for k in like[0] if k in d},
            {k: set(d[k]) for k in like[1] if k in d}, {k: d[k] for k in like[2] if k in d},
            {k: d[k] for k in like[3] if k in d})
        return per_layer, index_lists, parts, counts
    per_layer, index_lists = {}, {}
    for key, value in d.items():
        if not value:
            continue
        if key == "per_layer_config" and isinstance(value, dict):
            per_layer[key] = _per_layer(value, n)
        elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and (
                LAYER_LIST_INDEX.search(key) and all(0 <= v < n for v in value) and not (
                len(value) == n and set(value) <= {0, 1})):
            index_lists[key] = set(value)
        elif (isinstance(value, list) or isinstance(value, str) and "pattern" in key) and len(value) == n:
            per_layer[key] = value
    counts = {k: v for k, v in d.items() if re.fullmatch(r"(n|num)_\w+_layers", k) and isinstance(v, int)
              and not isinstance(v, bool) and 0 < v <= n}
    if sum(counts.values()) == n and len(counts) > 1:
        return per_layer, index_lists, counts, {}
    return per_layer, index_lists, {}, counts


def _per_layer(per_layer_config: dict, n: int) -> list:
    """per_layer_config ({"05": {...}}) as one entry per layer (a JSON string, or None)."""
    by_layer = {int(i): json.dumps(v, sort_keys=True) for i, v in per_layer_config.items()}
    return [by_layer.get(i) for i in range(n)]


def _meta_layer_shapes(config, n: int) -> list | None:
    """[(parameter name inside layer i, shape), ...] per layer, from the model built on the meta device; None when
    that build fails or shows no list of n layers (the config fields alone then describe the layers)."""
    import torch

    try:
        with torch.device("meta"):
            model = _quiet(auto_class(config).from_config, config)
    except Exception:  # noqa: BLE001 (a family whose __init__ needs real tensors)
        return None
    blocks = _decoder_blocks(model, n)
    if blocks is None:
        return None
    return [tuple(sorted((name, tuple(p.shape)) for name, p in block.named_parameters())) for block in blocks]


def _decoder_blocks(model, n: int):
    """The ModuleList of the text decoder's n layers (the first of that length outside the vision/audio towers)."""
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n and not TOWER.search(name):
            return module
    return None


def _keep_layers(d: dict, keep: list, count: str) -> dict:
    """A text config dict cut to the layers `keep` (per-layer fields subset, index lists and partitions
    renumbered, other counts of layers the same share of the kept ones), its layer count field `count` set to
    len(keep)."""
    n = d[count]
    per_layer, index_lists, parts, counts = _layer_fields(d, n)
    d = {**d, count: len(keep)}
    for key, c in counts.items():
        d[key] = len(keep) if c == n else max(1, min(round(c * len(keep) / n), len(keep) - 1))
    for key, value in per_layer.items():
        picked = [value[i] for i in keep]
        if key == "per_layer_config":
            width = len(next(iter(d[key])))  # keys as written: "05"
            d[key] = {str(j).zfill(width): json.loads(v) for j, v in enumerate(picked) if v is not None}
        else:
            d[key] = "".join(picked) if isinstance(value, str) else picked
    for key, members in index_lists.items():
        d[key] = [j for j, i in enumerate(keep) if i in members]
    start = 0
    for key, size in parts.items():
        d[key] = sum(start <= i < start + size for i in keep)
        start += size
    return d


def _text_key(config) -> str | None:
    """The sub-config key of the text decoder (None: the config is the text decoder)."""
    text = config.get_text_config(decoder=True)
    return next((k for k in config.sub_configs if getattr(config, k, None) is text), None)


def tiny_config(model_type: str, overrides: dict | None = None, prefix: bool = False):
    """A small config of the family: the class's defaults shrunk by SHRINK, then cut to the fewest layers that still
    hold every kind of layer of the default (_cut_layers). Consistency checks that the shrunk values fail are met
    by _construct's generic repairs. overrides: values set in the text decoder's shrunk fields; prefix: keep the
    shortest prefix of layers holding every kind (build_tiny's retries, for checks only the model makes)."""
    cls, base, small, key = _shrunk(model_type)
    if overrides:
        small = {**small, key: {**small[key], **overrides}} if key else {**small, **overrides}
    config, small = _construct(cls, small, base)
    text_dict = small.get(key) if key else small
    count = _layer_count_field(getattr(config, key) if key else config)
    if not isinstance(text_dict, dict) or count is None or not isinstance(text_dict.get(count), int):
        return config  # no layer count to cut (pi0, blt): widths only
    return _cut_layers(cls, config, small, key, base, count, prefix)


def _shrunk(model_type: str) -> tuple:
    """(config class, its default's dict, that dict shrunk, the text decoder's sub-config key or None)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = _quiet(cls)
    key = _text_key(default)
    base = default.to_dict()
    return cls, base, _match_text_width(_shrink_dict(base, set(cls.sub_configs), key, cls), base, key), key


def _cut_layers(cls, config, small: dict, key: str | None, base: dict, count: str, prefix: bool = False):
    """The config with layers cut. The fewest layers are the first layer of each kind, kept when the cut config's
    layers are those same kinds (the kinds live in per-layer fields it carries); where they come from a pattern
    the code applies by layer number (decoder_sparse_step, ...), the shortest prefix holding every kind instead,
    if it has at most MAX_LAYERS layers. A family whose checks refuse both keeps its layer count."""
    text = getattr(config, key) if key else config
    d = text.to_dict()
    like = _layer_fields(d, d[count])
    sigs = _layer_signatures(config, key, like)
    first = sorted({s: i for i, s in reversed(list(enumerate(sigs)))}.values())[:MAX_LAYERS]

    def cut(keep):
        text = _keep_layers(small[key] if key else small, keep, count)
        return _construct(cls, {**small, key: text} if key else text, base)[0]

    try:
        candidate = cut(first)
        if first[-1] == len(first) - 1 or not prefix and _layer_signatures(candidate, key, like) == [
                sigs[i] for i in first]:
            return candidate
    except Exception:  # noqa: BLE001 (the family's checks tie the layers together: try the prefix)
        candidate = config
    try:
        return cut(list(range(first[-1] + 1))) if first[-1] < MAX_LAYERS else candidate
    except Exception:  # noqa: BLE001
        return candidate


def _construct(cls, d: dict, default: dict) -> tuple:
    """(cls(**d), d), or where the config's own checks refuse d, the first generic repair they accept (_repairs);
    when none is accepted alone, the first one that moves the refusal to another check is kept and the search goes
    on from there (a few steps)."""
    d = {k: v for k, v in d.items() if k not in ("transformers_version", "model_type", "architectures")}
    for _ in range(4):
        try:
            return _quiet(cls, **d), d
        except Exception as error:  # noqa: BLE001 (any check may fail; its message says which)
            progress = None
            for fixed in _repairs(d, default):
                try:
                    return _quiet(cls, **fixed), fixed
                except Exception as other:  # noqa: BLE001
                    if progress is None and str(other) != str(error):
                        progress = fixed
            if progress is None:
                raise
            d = progress
    return _quiet(cls, **d), d


def _repairs(d: dict, default: dict):
    """Candidate fixes of d, cheapest first."""
    heads, head_dim = d.get("num_attention_heads"), d.get("head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int) and d.get("hidden_size") != heads * head_dim:
        yield {**d, "hidden_size": heads * head_dim}
    changed = [(default[k], k) for k, v in d.items() if k in default and isinstance(v, int)
               and isinstance(default[k], int) and v != default[k] and not k.endswith("_token_id")]
    for _, key in sorted(changed):
        yield {**d, key: default[key]}
    for key, sub in d.items():
        if isinstance(sub, dict) and isinstance(default.get(key), dict) and "model_type" in default[key]:
            for fixed in _repairs(sub, default[key]):
                yield {**d, key: fixed}


def _quiet(fn, *args, **kwargs):
    """fn(...) without transformers' warnings about unusual configs (a tiny model is one by design)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    finally:
        logging.set_verbosity(level)


# --- building ---------------------------------------------------------------------------------------------------

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
        raise NotBuilt(one_line(first_error) + _default_fails(model_type)) from first_error
    model.to(dtype or torch.bfloat16)
    model.config.family_sweep_repair = label  # saved in config.json: how the build got through
    _quiet(model.save_pretrained, folder)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    return Path(folder)


def _tiny_model(model_type: str, config, seed: int):
    """The model of `config`, filled and checked (see build_tiny)."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    _check_size(config)
    torch.manual_seed(seed)
    model = _quiet(auto_class(config).from_config, config, dtype=torch.float32).eval()
    _fill_uninitialised(model, torch.Generator().manual_seed(seed))
    model.to(torch.bfloat16).float()  # the check sees the weights as saved
    _check_forward(model, causal=model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return model


def _attempts(model_type: str, reverts: int = 8):
    """(label, tiny_config arguments) to try in turn: as shrunk; the head widths at their defaults, with as few
    heads as the width leaves (code that hard-codes rotary sections for the default width: Qwen2-VL's, GLM-4V's);
    the layers as a prefix; then one shrunk field of the text decoder at a time back at its default, the smallest
    first."""
    yield "", {}
    _, base, small, key = _shrunk(model_type)
    base, small = (base.get(key, {}), small.get(key, {})) if key else (base, small)
    heads, hidden = base.get("num_attention_heads"), base.get("hidden_size")
    widths = {k: v for k, v in base.items() if k.endswith("head_dim") and isinstance(v, int)}
    if isinstance(heads, int) and isinstance(hidden, int) and isinstance(small.get("hidden_size"), int):
        width = widths.setdefault("head_dim", hidden // heads)
        widths["num_attention_heads"] = max(1, small["hidden_size"] // width)
        for kv in [k for k in small if re.search(r"(key_value|kv)_heads$", k) and isinstance(small[k], int)]:
            widths[kv] = min(small[kv], widths["num_attention_heads"])
    if widths:
        yield "head widths at their defaults", {"overrides": widths}
    yield "layers as a prefix", {"prefix": True}
    changed = sorted((v, k) for k, v in base.items() if isinstance(v, int) and not isinstance(v, bool)
                     and isinstance(small.get(k), int) and small[k] != v and not k.endswith("_token_id"))
    for value, field in changed[:reverts]:
        yield f"{field} at its default ({value})", {"overrides": {field: value}}


def _default_fails(model_type: str) -> str:
    """' (... also fails ...)' when the family's own default config cannot build its model either."""
    import torch
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = _quiet(CONFIG_MAPPING[model_type])
        with torch.device("meta"):
            _quiet(auto_class(config).from_config, config)
    except Exception as e:  # noqa: BLE001
        return f" (the default config fails too: {one_line(e)[:120]})"
    return ""


def _check_size(config, limit: int = 200_000_000) -> None:
    """Refuses a config the table left big (a field it does not know), naming the largest parameters."""
    import torch

    with torch.device("meta"):
        model = _quiet(auto_class(config).from_config, config)
    sizes = sorted(((p.numel(), n) for n, p in model.named_parameters()), reverse=True)
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


def fp_logits(model):
    """The model's float32 logits on FORWARD_IDS (the reference every quantized model is compared with)."""
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor(FORWARD_IDS)).logits.float()


def _check_forward(model, causal: bool) -> None:
    """The fp model runs on FORWARD_IDS with finite logits; causal: changing the last token leaves every earlier
    position's logits alone."""
    import torch

    ids = torch.tensor(FORWARD_IDS)
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % 400 + 3
    with torch.inference_mode():
        a = model(input_ids=ids).logits[:, :-1]
        if not torch.isfinite(a).all():
            raise ValueError("the fp model's logits are not finite")
        if causal and not torch.allclose(a, model(input_ids=other).logits[:, :-1], rtol=1e-4, atol=1e-5):
            raise NotADecoder("not causal (logits of earlier positions depend on later tokens): not a decoder")


# --- the child processes ----------------------------------------------------------------------------------------

def child_build(model_type: str, folder: str, logits_path: str) -> dict:
    """Builds the model; saves the fp model's logits (its bf16 weights in float32) for the comparisons."""
    import torch
    import transformers
    from transformers import AutoConfig

    try:
        build_tiny(model_type, folder)
    except (NotBuilt, NotADecoder) as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 (the tokenizer, saving: the row says what)
        return {"error": one_line(e)}
    model_class = getattr(transformers, AutoConfig.from_pretrained(folder).architectures[0])  # the class saved
    model = _quiet(model_class.from_pretrained, folder, dtype=torch.float32).eval()
    torch.save(fp_logits(model), logits_path)
    text = model.config.get_text_config(decoder=True)
    layers = getattr(text, "layer_types", None) or getattr(text, "num_hidden_layers", None)
    return {"layers": layers if isinstance(layers, int) else len(layers or []),
            "params": sum(p.numel() for p in model.parameters()), "class": type(model).__name__,
            "repair": getattr(model.config, "family_sweep_repair", "")}


def child_check(out: str, logits_path: str) -> dict:
    """load_quantized(out) and one forward: {stage reached, relative logits error}."""
    import torch

    import quantkit

    try:
        model = quantkit.load_quantized(out)
    except Exception as e:  # noqa: BLE001 (any failure is the row's result)
        return {"stage": "load", "error": one_line(e)}
    try:
        logits = fp_logits(model)
    except Exception as e:  # noqa: BLE001
        return {"stage": "forward", "error": one_line(e)}
    ref = torch.load(logits_path)
    if logits.shape != ref.shape or not torch.isfinite(logits).all():
        return {"stage": "forward", "error": f"logits {tuple(logits.shape)} not finite or not {tuple(ref.shape)}"}
    return {"stage": "ok", "rel": ((logits - ref).norm() / ref.norm()).item()}


def one_line(error) -> str:
    """An exception (or a stderr text) as one line: the last non-empty line, with the exception's type."""
    text = str(error).strip()
    last = text.splitlines()[-1].strip() if text else ""
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {last}"[:300]
    return last[:300]


def run_child(argv: list, timeout: float, env=None) -> tuple:
    """(exit code or None on timeout, stdout, stderr) of a command, its whole process group killed on timeout."""
    import os
    import signal

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def _child_json(argv: list, timeout: float, env=None) -> tuple:
    """Runs `python this_script --child ...`: (its JSON answer or None, why not: 'timeout' or the error line)."""
    rc, out, err = run_child([sys.executable, __file__, "--child", *argv], timeout, env)
    if rc is None:
        return None, "timeout"
    lines = [line for line in out.splitlines() if line.startswith(ANSWER)]
    if rc == 0 and lines:
        return json.loads(lines[-1][len(ANSWER):]), None
    return None, error_line(err) or f"exit code {rc}"



def error_line(stderr: str) -> str:
    """quantkit's `error: ...` line, else a traceback's last line, else the last line (tqdm's bars aside)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and "%|" not in line]  # no progress bars
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1][:300]


# --- independent coverage ---------------------------------------------------------------------------------------

BLOCK = re.compile(r"^(.*?)\.(\d+)\.(.+)$")
PACKED = ("qweight", "weight_packed", "codes")
BLOCK_LISTS = ("layers", "h", "layer", "blocks", "block")
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def safetensors_headers(folder: Path) -> dict:
    """{tensor name: (dtype, shape)} of every *.safetensors file (headers only: no tensor is read)."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        tensors.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return tensors


def quantized_share(out: Path, bits: int) -> tuple:
    """(share, what stayed in float) of a checkpoint, from its files alone: elements of the packed layers (a
    prefix holding qweight/weight_packed/codes: its input features from g_idx, else int32 words x 32 / bits)
    over those plus every floating weight of two or more dims that stayed float, both inside the decoder blocks
    (_decoder_block_lists): embeddings, lm_head and vision/audio towers aside."""
    tensors = safetensors_headers(out)
    blocks = _decoder_block_lists(tensors)
    inside = {name: match.group(3) for name in tensors if (match := BLOCK.match(name)) and match.group(1) in blocks}
    packed, floats = 0, {}
    prefixes = {name.rsplit(".", 1)[0] for name in inside if name.rsplit(".", 1)[-1] in PACKED}
    for prefix in prefixes:
        word = next(f"{prefix}.{s}" for s in PACKED if f"{prefix}.{s}" in tensors)
        shape = tensors[word][1]
        g_idx = tensors.get(f"{prefix}.g_idx") or tensors.get(f"{prefix}.weight_g_idx")
        packed += g_idx[1][0] * shape[-1] if g_idx and word.endswith("qweight") else math.prod(shape) * 32 // bits
    for name, rest in inside.items():
        dtype, shape = tensors[name]
        if (dtype in FLOAT_DTYPES and len(shape) >= 2 and not name.endswith("bias")
                and name.rsplit(".", 1)[0] not in prefixes):
            kind = re.sub(r"\.\d+\.", ".N.", rest)
            floats[kind] = floats.get(kind, 0) + math.prod(shape)
    total = packed + sum(floats.values())
    kept = sorted(floats, key=floats.get, reverse=True)
    what = ", ".join(kept[:3]) + (f" (+{len(kept) - 3} more)" if len(kept) > 3 else "")
    return (packed / total if total else 0.0), (what or "nothing")


def _decoder_block_lists(tensors: dict) -> set:
    """The prefixes of the text decoder's blocks in a checkpoint's names (model.layers, transformer.h, ...): lists
    named as BLOCK_LISTS names them, outside the vision/audio towers, of the first of those names present (a
    vision tower saved as top-level `blocks.N` beside the text's `layers.N`)."""
    lists = {m.group(1) for name in tensors if (m := BLOCK.match(name)) and not TOWER.search(m.group(1))}
    for kind in BLOCK_LISTS:
        found = {p for p in lists if p.rsplit(".", 1)[-1] == kind}
        if found:
            return found
    return set()


# --- the sweep --------------------------------------------------------------------------------------------------

def quantize_argv(src: Path, out: Path, method: str, dataset: str) -> list:
    """The command line under test, as a user types it (--device cpu: no GPU probing)."""
    return ["quantkit", "quantize", str(src), "-o", str(out), "--method", method, "--bits", "4", "--group-size", "32",
            "--nsamples", "8", "--seqlen", "64", "--dataset", dataset, "--device", "cpu"]


def run_method(src: Path, logits: Path, out: Path, method: str, args) -> dict:
    """quantize, then load + forward, within args.timeout seconds in all: {status, rel, share, float, summary,
    why}."""
    t0 = time.perf_counter()
    rc, stdout, stderr = run_child(quantize_argv(src, out, method, args.dataset), args.timeout, args.env)
    summary = next((line.strip() for line in reversed(stdout.splitlines()) if line.startswith("quantized ")), "")
    if rc is None:
        return {"status": "timeout", "why": f"quantize ran past {args.timeout:.0f} s", "summary": summary}
    if rc != 0:
        return {"status": "quantize failed", "why": error_line(stderr) or f"exit code {rc}", "summary": summary}
    share, floats = quantized_share(out, 4)
    row = {"share": share, "float": floats, "summary": summary}
    left = max(10.0, args.timeout - (time.perf_counter() - t0))
    answer, why = _child_json(["check", str(out), str(logits)], left, args.env)
    if answer is None:
        return {**row, "status": "timeout" if why == "timeout" else "load failed", "why": why}
    if answer["stage"] != "ok":
        return {**row, "status": f"{answer['stage']} failed", "why": answer["error"]}
    return {**row, "status": "ok", "rel": answer["rel"]}


def run_family(model_type: str, args) -> dict:
    """One row: build, then every method (each in child processes of its own)."""
    t0 = time.perf_counter()
    work = Path(args.workdir) / model_type
    if (work / MARKER).exists():
        shutil.rmtree(work)  # a folder of an earlier sweep (nothing else is ever deleted)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).touch()
    src, logits = work / "fp", work / "fp_logits.pt"
    built, why = _child_json(["build", model_type, str(src), str(logits)], args.timeout, args.env)
    row = {"family": model_type, "methods": {}}
    if built is None or "error" in built:
        why = built["error"] if built else "build ran past the timeout" if why == "timeout" else why
        return {**row, "status": "not built", "why": why, "seconds": time.perf_counter() - t0}
    row["built"] = built
    for method in args.methods:
        row["methods"][method] = run_method(src, logits, work / method, method, args)
    failed = [(m, r) for m, r in row["methods"].items() if r["status"] != "ok"]
    row["status"] = failed[0][1]["status"] if failed else "ok"
    row["why"] = "; ".join(f"{m}: {r['why']}" for m, r in failed) if failed else (
        f"built with {built['repair']}" if built.get("repair") else "")
    row["seconds"] = time.perf_counter() - t0
    return row



def markdown(rows: list, methods: list) -> str:
    """The results as one markdown table, a row per family."""
    head = ["family", "status", "quantized share", *[f"{m} rel err" for m in methods], "stayed in float", "why",
            "quantkit's summary"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        results = row["methods"]
        done = [r for r in results.values() if "share" in r]
        share = " / ".join(sorted({f"{100 * r['share']:.1f} %" for r in done})) or "-"
        errors = [f"{results[m]['rel']:.4f}" if "rel" in results.get(m, {}) else "-" for m in methods]
        floats = done[0]["float"] if done else "-"
        why = row.get("why", "").replace("|", "\\|")
        said = next((r["summary"] for r in results.values() if r.get("summary")), "-")
        lines.append(f"| {row['family']} | {row['status']} | {share} | {' | '.join(errors)} | {floats} | {why} | "
                     f"{said} |")
    return "\n".join(lines)


def header(argv: list, seconds: float) -> str:
    """The paragraph above the table: what ran, when, against which versions, how long."""
    import transformers

    return (f"# quantkit across transformers' decoder families\n\n"
            f"`python scripts/family_sweep.py {' '.join(argv)}` on {date.today().isoformat()}: transformers "
            f"{transformers.__version__}, quantkit from {quantkit_tree()}, {seconds / 60:.1f} min in all. Each "
            "family: a tiny random model from its config class's defaults, `quantkit quantize --bits 4 --group-size "
            "32 --nsamples 8 --seqlen 64`, load_quantized and one forward; rel err = ||q - fp|| / ||fp|| of the "
            "logits; quantized share counted from the checkpoint's files (decoder blocks only: embeddings, lm_head "
            "and vision/audio towers aside).\n\n")


def quantkit_tree() -> str:
    """Where the children's quantkit comes from (PYTHONPATH may point elsewhere), with its git commit if any."""
    from importlib.util import find_spec

    folder = Path(find_spec("quantkit").origin).parent
    commit = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return f"{folder}" + (f" (git {commit}, with any uncommitted changes)" if commit else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", help="model_types (default: every decoder family)")
    ap.add_argument("--methods", nargs="+", default=["rtn", "gptq"])
    ap.add_argument("--workdir", default="/tmp/quantkit_family_sweep")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per family and method (and for the build)")
    ap.add_argument("--out", help="write the markdown table here (default: print only)")
    ap.add_argument("--jobs", type=int, default=1, help="families swept at once")
    ap.add_argument("--json", help="also write the rows (every method's result) as JSON here")
    ap.add_argument("--dataset", default=str(CALIB if CALIB.exists() else REPO / "README.md"),
                    help="calibration text file (default: ../shared's WikiText-2 validation text, else README.md)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        answer = {"build": child_build, "check": child_check}[kind](*rest)
        print(ANSWER + json.dumps(answer), flush=True)
        return
    families = args.families or decoder_families()
    args.env = _child_env(args.jobs)
    t0 = time.perf_counter()
    rows = sweep(families, args)
    seconds = time.perf_counter() - t0
    table = markdown(rows, args.methods)
    print(f"\n{table}\n\n{len(rows)} families in {seconds / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps({"seconds": seconds, "rows": rows}, indent=1))
    if args.out:
        Path(args.out).write_text(header(sys.argv[1:] if argv is None else argv, seconds) + table + "\n")


def sweep(families: list, args) -> list:
    """run_family over the families, args.jobs at a time, in the given order; a line of progress per family."""
    from concurrent.futures import ThreadPoolExecutor

    done = []

    def one(model_type):
        row = run_family(model_type, args)
        done.append(model_type)
        print(f"[{len(done)}/{len(families)}] {model_type}: {row['status']} ({row['seconds']:.0f} s) "
              f"{row.get('why', '')}"[:200], flush=True)
        print(ROW + json.dumps(row), flush=True)  # each finished row whole: a sweep cut short still has them
        return row

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return list(pool.map(one, families))


def _child_env(jobs: int):
    """The children's environment: the cores shared between the jobs running at once."""
    import os

    if jobs <= 1:
        return None
    return {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}


if __name__ == "__main__":
    main()

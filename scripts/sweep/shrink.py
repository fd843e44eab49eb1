"""A family's default config dict shrunk by one table of field names (SHRINK, no entry per family), then constructed
again, with generic repairs where the config's own checks refuse the shrunk values."""
import dataclasses
import re

from sweep.common import config_class, quiet

PAD, BOS, EOS = 0, 1, 2  # the bundled stories260k tokenizer's
VOCAB = 512
# Special tokens (image, audio, ...) that the default config places past the small vocabulary move to its top ids,
# down to this floor; the ids the models are run on stay below it.
SPARE_FLOOR = 403

EXPERTS = r"(^|_)(num_local_experts|num_experts|n_routed_experts|moe_num_experts|num_routed_experts|n_experts)$"
# (field-name pattern, value it shrinks to): first match wins; an int field is lowered to the value, never raised;
# None (a feature turned off) stays None. Applies to the config and to every nested sub-config alike.
SHRINK = [
    (r"vocab_size|_vocab$", VOCAB),  # _vocab: BLT's hash n-gram vocabulary
    (r"^q_lora_rank$", 32),
    (r"lora_rank$", 16),
    (r"qk_rope_head_dim$", 16),
    (r"qk_nope_head_dim$", 16),
    (r"head_?dim$|^kv_channels$|^d_head$|head_size$", 32),  # headdim: Zamba2's Mamba heads
    (r"rotary_dim$", 16),
    (r"(moe|expert).*(intermediate|ffn|hidden)_size|(intermediate|ffn)_size.*(moe|expert)", 64),
    (r"_per_layer_input$", 32),
    (r"intermediate_size|^ffn_dim$|^n_inner$|ffn_hidden_size|^mlp_dim$|^d_ff$|^ff_dim$|^d_inner$", 256),
    (r"hidden_size(_\w+)?$|^(n_embd|d_model|dim|embed_dim|embedding_dim|model_dim|hidden_dim|projection_dim)$", 128),
    (r"(key_value|kv)_heads|^multi_query_group_num$|^n_head_kv$|^num_kv$|linear_num_key_heads$", 2),
    (r"(^|_)(n_head|n_heads|num_heads)$|num_.*heads$|attention_heads$", 4),
    (r"n_groups$", 1),
    (EXPERTS, 4),
    (r"shared_experts$", 1),
    (r"^zero_expert_num$", 2),  # LongCat-Flash's identity experts: 256 beside 4 routed would take every token
    (r"experts_per_tok|^moe_topk$|^moe_top_k$|^moe_k$|^num_experts_per_token$|^top_k_experts$", 2),
    (r"^(n_group|topk_group|num_group|num_expert_group|topk_expert_group)$", 1),
    (r"max_position_embeddings|^n_positions$|^n_ctx$|^max_seq_len$", 256),
    (r"sliding_window$|^attention_window$", 32),
    (r"^first_k_dense_replace$|^num_dense_layers$", 1),
]


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
    spare = iter(range(VOCAB - 1, SPARE_FLOOR - 1, -1))
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



def shrink_dict(d: dict, sub_keys: set, text_key: str | None = None, cls=None) -> dict:
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
            value = shrink_dict(value, set(), cls=config_class(value.get("model_type")) if key == text_key else None)
        elif key == "per_layer_config" and isinstance(value, dict):
            value = {i: shrink_dict(entry, set()) for i, entry in value.items()}
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


def rope_dim(d: dict):
    """The width of one attention head that rotary embeddings see (before any partial rotary factor)."""
    for key in ("qk_rope_head_dim", "head_dim"):
        if isinstance(d.get(key), int):
            return d[key]
    heads = d.get("num_attention_heads")
    return d["hidden_size"] // heads if isinstance(heads, int) and isinstance(d.get("hidden_size"), int) else None


def _scale_rope_sections(before: dict, after: dict) -> None:
    """Multimodal RoPE sections (mrope_section: how the rotary dims split over time/height/width) shrunk with the
    head width, their sum kept at the same share of it."""
    old, new = rope_dim(before), rope_dim(after)
    rope = after.get("rope_parameters")
    if not (old and new and isinstance(rope, dict)):
        return
    for params in [rope, *[v for v in rope.values() if isinstance(v, dict)]]:
        sections = params.get("mrope_section")
        if isinstance(sections, list) and sections and old != new:
            scaled = [max(1, s * new // old) for s in sections]
            scaled[0] += sum(sections) * new // old - sum(scaled)
            params["mrope_section"] = scaled


# --- values for build_tiny's retries (_attempts) ------------------------------------------------------------------

def fitted_mrope_sections(d: dict, cls) -> list | None:
    """[time, height, width] rotary sections for a text config dict whose class reads mrope_section but whose flat
    rope_parameters set none, where the modeling code falls back to sections it hard-codes for one width: the
    shrunk rotary half width split 2:3:3, as those hard-coded sections are (Qwen2-VL's [16, 24, 24], GLM-4V's
    [8, 12, 12]). None where there is nothing to fit."""
    rope = d.get("rope_parameters")
    if ("mrope_section" not in (getattr(cls, "ignore_keys_at_rope_validation", None) or ())
            or not isinstance(rope, dict) or "rope_type" not in rope or "mrope_section" in rope):
        return None
    factor = rope.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1
    half = int((rope_dim(d) or 0) * factor) // 2
    if half < 3:
        return None
    time = half // 4
    height = (half - time) // 2
    return [time, height, half - time - height]


def table_values_for_unset(d: dict) -> dict:
    """{field: the table's value} for each field of d that the table names and d leaves None (not its
    sub-configs): a retry for code that needs a value its default config does not set."""
    return {k: value for k in d if d[k] is None and (value := table_value(k)) is not None}


def undeclared(cls, d: dict) -> list:
    """d's int and list fields that cls does not declare: in a default config's dict (nothing was passed in) those
    are what its __post_init__ derived, and passed in again they override its derivation from the shrunk fields
    (Zamba2's attention_hidden_size = 2 x hidden_size, hybrid_layer_ids from the cut layers_block_type)."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return []
    declared = {f.name for f in dataclasses.fields(cls)}
    return [k for k, v in d.items() if k not in declared and (_is_int(v) or isinstance(v, list))
            and not k.endswith("_token_id")]


def table_value(name: str):
    """The value the table shrinks field `name` to, or None where no pattern names it."""
    return next((small for pattern, small in SHRINK if re.search(pattern, name)), None)


def merged(d: dict, extra: dict) -> dict:
    """d with extra's fields set, nested dicts (sub-configs) merged field by field."""
    out = dict(d)
    for key, value in extra.items():
        out[key] = merged(d[key], value) if isinstance(value, dict) and isinstance(d.get(key), dict) else value
    return out


# --- constructing the config ------------------------------------------------------------------------------------

def match_text_width(d: dict, default: dict, text_key: str | None) -> dict:
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


def construct(cls, d: dict, default: dict, text_key: str | None = None) -> tuple:
    """(cls(**d), d), or where the config's own checks refuse d, the first generic repair they accept (_repairs);
    when none is accepted alone, the first one that moves the refusal to another check is kept and the search goes
    on from there (a few steps)."""
    d = {k: v for k, v in d.items() if k not in ("transformers_version", "model_type", "architectures")}
    for _ in range(4):
        try:
            return quiet(cls, **d), d
        except Exception as error:  # noqa: BLE001 (any check may fail; its message says which)
            progress = None
            for fixed in _repairs(d, default, text_key):
                try:
                    return quiet(cls, **fixed), fixed
                except Exception as other:  # noqa: BLE001
                    if progress is None and str(other) != str(error):
                        progress = fixed
            if progress is None:
                raise
            d = progress
    return quiet(cls, **d), d


def _repairs(d: dict, default: dict, text_key: str | None = None, top: bool = True):
    """Candidate fixes of d, cheapest first: width aliases following the widths they alias (at the top only: it
    covers the sub-configs), heads x head width = hidden, one shrunk field back at its default, the same in each
    sub-config."""
    if top and (aliased := _widths_follow(d, default, text_key)) != d:
        yield aliased
    heads, head_dim = d.get("num_attention_heads"), d.get("head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int) and d.get("hidden_size") != heads * head_dim:
        yield {**d, "hidden_size": heads * head_dim}
    changed = [(default[k], k) for k, v in d.items() if k in default and isinstance(v, int)
               and isinstance(default[k], int) and v != default[k] and not k.endswith("_token_id")]
    for _, key in sorted(changed):
        yield {**d, key: default[key]}
    for key, sub in d.items():
        if isinstance(sub, dict) and isinstance(default.get(key), dict) and "model_type" in default[key]:
            for fixed in _repairs(sub, default[key], top=False):
                yield {**d, key: fixed}


WIDTH_ALIAS = re.compile(r"(dim|hidden_size|input_size|output_size)$")  # names a width may go by


def _widths_follow(d: dict, default: dict, text_key: str | None = None) -> dict:
    """d with each width field the table does not name, left at its default, set to the new value of the width the
    table shrank from that same default: in a tower, the text decoder's hidden_size first (Dots3's adapter_out_dim,
    checked to equal it), then the tower's own widths (its adapter_in_dim, checked to equal its hidden_size)."""
    text_width = {}
    if text_key and isinstance(d.get(text_key), dict) and isinstance(default.get(text_key), dict):
        text_width = _shrunk_widths({"hidden_size": d[text_key].get("hidden_size")},
                                    {"hidden_size": default[text_key].get("hidden_size")})
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and isinstance(default.get(key), dict):
            value = _aliases_set(value, default[key], {} if key == text_key else text_width)
        out[key] = value
    return _aliases_set(out, default, {})


def _aliases_set(d: dict, default: dict, first: dict) -> dict:
    """d's width aliases (WIDTH_ALIAS names the table does not know, at their default) set to the new value of a
    width shrunk from the same default: first's ({old: new}), else d's own. Values below 256 are left alone: counts
    and patch sizes equal a small width by chance, a width alias is a width of the default model."""
    new = {**_shrunk_widths(d, default), **first}
    return {key: new[value] if (_is_int(value) and value == default.get(key) and value in new and value >= 256
                                and WIDTH_ALIAS.search(key) and table_value(key) is None) else value
            for key, value in d.items()}


def _shrunk_widths(d: dict, default: dict) -> dict:
    """{default value: shrunk value} of d's fields the table shrank (hidden_size's value wins a tie)."""
    new = {}
    for key in sorted(d, key=lambda k: k == "hidden_size"):
        value, old = d[key], default.get(key)
        if _is_int(value) and _is_int(old) and value != old and table_value(key) is not None:
            new[old] = value
    return new


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)



"""The fewest decoder layers that keep every kind of layer the default config has: each layer described by its
entries in the config's per-layer fields and by its parameters' shapes, and the config cut to the first layer of
each kind (or, where a pattern only the modeling code knows decides the kinds, to the shortest prefix)."""
import json
import re

from sweep.common import TOWER, auto_class, quiet
from sweep.shrink import construct

MAX_LAYERS = 6
LAYER_LIST_INDEX = re.compile(r"idx|index|indices|indexes|_layers$")  # lists of layer numbers, not one per layer


def cut_layers(cls, config, small: dict, key: str | None, base: dict, count: str, prefix: bool = False,
               per_kind: int = 1):
    """The config with layers cut. The fewest layers are the first layer of each kind (the first per_kind layers),
    kept when the cut config's layers are those same kinds (the kinds live in per-layer fields it carries); where
    they come from a pattern the code applies by layer number (decoder_sparse_step, ...), the shortest prefix
    holding every kind instead, if it has at most MAX_LAYERS layers. A family whose checks refuse both keeps its
    layer count."""
    text = getattr(config, key) if key else config
    d = text.to_dict()
    like = _layer_fields(d, d[count])
    sigs = _layer_signatures(config, key, like)
    first = _first_of_each_kind(sigs, per_kind)[:MAX_LAYERS * per_kind]

    def cut(keep):
        text = _keep_layers(small[key] if key else small, keep, count)
        return construct(cls, {**small, key: text} if key else text, base, key)[0]

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


def _first_of_each_kind(signatures: list, per_kind: int) -> list:
    """The numbers of the first per_kind layers of each signature, in layer order."""
    seen, keep = {}, []
    for i, signature in enumerate(signatures):
        seen[signature] = seen.get(signature, 0) + 1
        if seen[signature] <= per_kind:
            keep.append(i)
    return keep


def _layer_signatures(config, key: str | None, like: tuple | None = None) -> list:
    """One hashable description per layer of the text decoder (config.<key>, or config itself): its entries in the
    per-layer fields (layer_types, mlp_layer_types, hybrid patterns, masks, per_layer_config), its membership of
    index lists (mlp_only_layers, full_attn_idxs) and of layer-count partitions (n_input_layers + n_recurrent_layers
    + ...), and the names and shapes of its parameters in a meta-device build of the whole model (which catches
    patterns only the modeling code knows: decoder_sparse_step, attn_layer_period, moe_layer_freq). like: the
    full config's _layer_fields, to read a cut config's fields as the full config's were read."""
    text = getattr(config, key) if key else config
    d = text.to_dict()
    n = d[layer_count_field(text)]
    per_layer, index_lists, parts, _ = _layer_fields(d, n, like)
    segment = [k for k, size in parts.items() for _ in range(size)]
    sigs = [tuple((k, v[i]) for k, v in per_layer.items()) + tuple((k, i in v) for k, v in index_lists.items())
            + ((segment[i],) if segment else ()) for i in range(n)]
    shapes = _meta_layer_shapes(config, n)
    return [s + shapes[i] for i, s in enumerate(sigs)] if shapes else sigs


def layer_count_field(config) -> str | None:
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
            model = quiet(auto_class(config).from_config, config)
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

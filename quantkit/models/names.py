"""Tensor names in the files against names in the model.

transformers 5 renames some families' tensors on load (conversion_mapping.py): Mixtral's `block_sparse_moe` becomes
`mlp`, Qwen2.5-VL's `model.layers` becomes `model.language_model.layers`, Gemma 3's `language_model.model` becomes
`model.language_model`; and quantkit.models.moe names split experts `experts.E.gate_proj|up_proj|down_proj`, where
Mixtral's files say `experts.E.w1|w3|w2`. quantkit works on the names the model holds and writes the names
transformers' own save_pretrained writes, which are the original releases' names and what vLLM's loaders read
(docs/FORMAT.md, "Tensor names"). FileNames maps one way and back; the renamings are transformers' own, reversed as
its save_pretrained reverses them (transformers.core_model_loading.revert_weight_conversion), so a family
transformers learns to rename needs no entry here. transformers 4 renames nothing on load: names stay as they are.
"""
import re

from torch import nn



class FileNames:
    """of_tensor / of_module: a model's name in the files; to_model: the inverse over the model's own names."""

    def __init__(self, model: nn.Module):
        self.experts = [_expert_rule(a, b) for a, b in _released_expert_names(model)]
        self.rename = _saved_renaming(model)
        self._modules = None
        self.model = model

    def of_tensor(self, name: str) -> str:
        for pattern, replacement in self.experts:
            name, n = pattern.subn(replacement, name)
            if n:
                break
        return self.rename(name)

    def of_module(self, name: str) -> str:
        # transformers' patterns are written against tensor names (`.mlp.` inside one): give the module a leaf
        return self.of_tensor(f"{name}.weight").removesuffix(".weight")

    def to_model(self, name: str) -> str:
        """The model's name of a tensor named `name` in the files (itself when nothing of the model is so named): by
        the model's own renaming of its tensors first (Kimi-Linear's self_attn.A_log is the model's
        self_attn.forget_gate.A_log, DeepSeek-V4's hc_attn_fn its attn_hc.fn), else by its module's (a packed layer's
        qweight sits where the linear's weight was)."""
        self._index()
        if name in self._tensors:
            return self._tensors[name]
        return self._by_prefix(name)

    def module_to_model(self, name: str) -> str:
        """The model's name of a module named `name` in the files (a module's name may equal another tensor's: Inkling
        saves sconv.weight_proj.weight as k_sconv.weight_proj, the name of the module sconv.weight_proj too)."""
        self._index()
        return self._modules[name] if name in self._modules else self._by_prefix(name)

    def _by_prefix(self, name: str) -> str:
        """`name` under its longest prefix the model names (a module, or a tensor quantkit.models.sliced split into
        `<tensor>.<e>` layers after these names were read), renamed as that prefix is; else `name` itself."""
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            head, rest = ".".join(parts[:cut]), ".".join(parts[cut:])
            known = self._modules.get(head) or self._tensors.get(head)
            if known is not None:
                return f"{known}.{rest}"
        return name

    def _index(self) -> None:
        if self._modules is None:
            self._tensors = {self.of_tensor(t): t for t in self.model.state_dict(keep_vars=True)}
            self._modules = {self.of_module(m): m for m, _ in self.model.named_modules() if m}


def _expert_rule(in_model: str, in_files: str):
    """(pattern, replacement) for one _released_expert_names pair; {E} is the expert's number, matched whole
    components."""
    pattern = re.escape(in_model).replace(r"\{E\}", r"(\d+)")
    return re.compile(rf"(?<=\.){pattern}(?=\.|$)"), in_files.replace("{E}", r"\1")


SPLIT_LEAVES = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}


def _released_expert_names(model: nn.Module) -> list:
    """(split expert's name, its name in the release) pairs read off transformers' own converters, which merge the
    release's per-expert tensors into fused ones: DeepSeek-V4's `experts.*.w1.weight` and `experts.*.w3.weight` make
    `experts.gate_up_proj`, so its split gate_proj is saved as w1, up_proj as w3, down_proj as w2 (Mixtral's too)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # transformers 4 converts nothing
        return []
    pairs = []
    for c in get_model_conversion_mapping(model, add_legacy=False):
        if not isinstance(c, WeightConverter) or len(c.target_patterns) != 1:
            continue
        fused = c.target_patterns[0].rpartition("experts.")[2]
        leaves = [re.fullmatch(r".*experts\.\*\.(\w+)\.weight", src.replace("\\", "")) for src in c.source_patterns]
        if fused in SPLIT_LEAVES and len(leaves) == len(SPLIT_LEAVES[fused]) and all(leaves):
            pairs += [(f"experts.{{E}}.{ours}", f"experts.{{E}}.{m.group(1)}")
                      for ours, m in zip(SPLIT_LEAVES[fused], leaves) if m.group(1) != ours]
    return pairs


def _saved_renaming(model: nn.Module):
    """name -> the name transformers' save_pretrained gives it, for `model` (built from a config)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightRenaming, apply_renamings
    except ImportError:  # transformers 4: the model holds the names of its files
        return str
    # as revert_weight_conversion does for a model not loaded by from_pretrained: no legacy renamings, no prefix
    # changes, the transforms reversed in reverse order (converters fuse experts, which quantkit has split)
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    renamings = [r for r in (c.reverse_transform() for c in conversions[::-1]) if isinstance(r, WeightRenaming)]
    return (lambda name: apply_renamings(name, renamings)) if renamings else str

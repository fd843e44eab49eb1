"""What a run quantizes and what stays in floating point, decided before any work and said at the end.

Every weight of the model (a floating-point parameter of two or more dims) is of one kind:
  quantized      the weight of a linear the run quantizes
  recipe         a linear (or another weight) a recipe override keeps in float (`skip: true`)
  lm_head        the output projection, kept in float (tied to the embeddings or not) unless --lm-head quantizes
                 it (then "quantized"; a tied one is untied, the embeddings stay)
  embeddings     input embedding tables (not linear weights: left out of the share)
  outside        another weight outside the decoder blocks (position tables, a vision tower)
and inside the decoder blocks, by how the block's forward uses it (quantkit.models.uses, from a trace):
  router         a linear whose output selects experts, kept in float (routing decisions must not move)
  read           a linear whose weight the model's own code reads (a packed layer has none), kept in float
  unused         a weight the forward never reads
  conv, other    convolution kernels, SSM parameters and other weights not multiplied as linear layers (not linear
                 weights: named, left out of the share)
A weight inside the decoder blocks that is none of these (fused 3-D experts that could not be split into linears) is
refused before any work, with its name, what it is, and the recipe override that keeps it in float: a checkpoint
must never be mostly floating point without a word.
"""
import re
from dataclasses import dataclass, field

from torch import nn

from quantkit.core.errors import QuantkitError
from quantkit.models.arch import expert_count, is_router
from quantkit.models.uses import kind_words

ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # a linear of a routed expert (quantkit.models.moe)

FLOAT_KINDS = ("recipe", "router", "read", "unused", "shared", "lm_head", "outside")  # the float kinds the share counts
SUMMARY_ORDER = ("recipe", "conv", "other", "router", "read", "unused", "shared", "lm_head", "embeddings",
                 "outside")


@dataclass
class Coverage:
    """{kind: {weight name: number of elements}} of a model's weights."""
    kinds: dict = field(default_factory=dict)

    def add(self, kind: str, name: str, numel: int) -> None:
        self.kinds.setdefault(kind, {})[name] = numel

    def elements(self, kind: str) -> int:
        return sum(self.kinds.get(kind, {}).values())

    @property
    def share(self) -> float:
        """Quantized elements over all linear weights (embeddings aside)."""
        total = self.elements("quantized") + sum(self.elements(k) for k in FLOAT_KINDS)
        return self.elements("quantized") / total if total else 0.0

    def summary(self) -> str:
        """One line: "quantized 97.3 % of linear weights (210 linears); in floating point: 24 routers, 4 conv
        kernels, lm_head"."""
        counts = {k: len(self.kinds.get(k, {})) for k in SUMMARY_ORDER}
        words = {"recipe": f"{counts['recipe']} weight(s) kept by the recipe", "lm_head": "lm_head",
                 "embeddings": "embeddings",
                 "outside": f"{counts['outside']} other weight(s) outside the decoder blocks"}
        floats = [words[k] if k in words else kind_words(k, n) for k, n in counts.items() if n]
        return (f"quantized {100 * self.share:.1f} % of linear weights ({len(self.kinds.get('quantized', {}))} "
                f"linears); in floating point: {', '.join(floats) or 'nothing'}")

    def to_report(self, name=str) -> dict:
        """The share, and the weights of each float kind under name(weight) (their names in the files)."""
        return {"quantized_share": round(self.share, 6),
                **{kind: sorted(map(name, names)) for kind, names in self.kinds.items() if kind != "quantized"}}


def weight_coverage(model: nn.Module, blocks_path: str, specs: dict, config, traced=None) -> Coverage:
    """The kind of every weight of `model` (a skeleton is enough: only shapes are read). specs: {quantizable
    linear: LayerSpec, None when the recipe skips it}; config: the run's QuantConfig (its overrides); traced: each
    block's BlockUses (quantkit.calibration.capture.trace_blocks), the kinds of the weights it does not quantize
    (without it, routers are known by name and shape and every other block weight is refused)."""
    coverage, unknown = Coverage(), []
    traced_kinds = _traced_kinds(traced or (), blocks_path)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    experts = expert_count(model.config)
    for name, p in _distinct_parameters(model):
        if p.dim() < 2 or not p.is_floating_point():
            continue  # norms, biases, integer buffers: not weights
        module = name.rpartition(".")[0]
        kind = _kind(name, p, module, specs, config, blocks_path, experts, embeddings, head, traced_kinds)
        if kind is None or kind == "experts":
            unknown.append((name, tuple(p.shape)))
        else:
            coverage.add(kind, name, p.numel())
    if unknown:
        raise QuantkitError(_unknown_message(unknown, blocks_path))
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    if head_name in specs and id(head.weight) in embeddings:  # --lm-head of a tied model: two weights once written
        coverage.add("quantized" if specs[head_name] is not None else "lm_head", f"{head_name}.weight",
                     head.weight.numel())
    return coverage


def _traced_kinds(traced, blocks_path) -> dict:
    """{full weight name: its kind by use} over the traced blocks."""
    return {f"{blocks_path}.{i}.{n}": kind for i, uses in enumerate(traced) for n, kind in uses.kinds.items()}


def _kind(name, p, module, specs, config, blocks_path, experts, embeddings, head, traced_kinds):
    if module in specs and name.endswith(".weight"):
        return "quantized" if specs[module] is not None else "recipe"
    if id(p) in embeddings:
        return "embeddings"
    if head is not None and p is getattr(head, "weight", None):
        return "lm_head"
    if not name.startswith(blocks_path + "."):
        return "outside"
    traced = traced_kinds.get(name)
    if traced == "experts" and not experts:  # a dense model's 3-D product weight (RecurrentGemma's gates)
        return "other"
    if traced not in (None, "experts"):  # fused experts left unsplit: kept only by the recipe
        return traced
    if is_router(module, p, experts):
        return "router"
    if config.spec_for(module) is None or config.spec_for(name) is None:
        return "recipe"
    return None


def _distinct_parameters(model):
    """(name, parameter) once per tensor: a tied lm_head is the embedding itself."""
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


def _unknown_message(unknown, blocks_path) -> str:
    name, shape = unknown[0]
    what = ("a fused 3-D expert tensor (a mixture-of-experts layer's experts, all in one tensor) in a layout "
            "quantkit.models.moe cannot split into one linear per expert" if len(shape) == 3
            else "a weight the architecture table does not list as a linear to quantize")
    # the weights themselves, in every block: no broader (a pattern 'mamba' would keep every Mamba linear in float)
    leaves = sorted({re.escape(re.sub(rf"^{re.escape(blocks_path)}\.\d+\.", "", n)) for n, _ in unknown})
    pattern = "\\." + (leaves[0] if len(leaves) == 1 else "(" + "|".join(leaves) + ")") + "$"
    more = f" (and {len(unknown) - 1} more weights)" if len(unknown) > 1 else ""
    return (f"{name} {list(shape)}{more} is {what}: this version cannot quantize it and would leave it in floating "
            f"point. Keep it in float knowingly with a recipe override (modules: - pattern: '{pattern}' skip: true), "
            "or quantize another model")


def expert_calibration(layers: dict, name=str) -> dict | None:
    """The calibration tokens routed to each expert, from the report's layers (None without experts or calibration):
    {"tokens": {expert: routed tokens}, "calibrated_on": {expert: tokens its statistics saw} (all of them with
    --moe-calibration all), "uncalibrated": [experts no token reached: rounded to nearest], "summary": one line}.
    layers are keyed by the model's names; an expert is named name(its gate_proj's module), e.g.
    "model.layers.1.mlp.experts.3"."""
    gates = {name(n.rpartition(".")[0]): layer for n, layer in layers.items()
             if ROUTED_EXPERT.search(n) and n.endswith(".gate_proj") and "tokens" in layer}
    if not gates:
        return None
    routed = {e: layer.get("routed_tokens", layer["tokens"]) for e, layer in gates.items()}
    seen = {e: layer["tokens"] for e, layer in gates.items()}
    counts = sorted(routed.values())
    line = (f"calibration tokens routed per expert: min {counts[0]}, median {counts[len(counts) // 2]}, max "
            f"{counts[-1]} over {len(counts)} experts")
    if any(seen[e] > routed[e] for e in gates):
        line += f" (statistics from all {max(seen.values())} tokens: --moe-calibration all)"
    none = sorted(e for e, n in seen.items() if n == 0)
    if none:
        line += f"; {len(none)} received none and were rounded to nearest ({none[0]}{', ...' if len(none) > 1 else ''})"
    return {"tokens": routed, "calibrated_on": seen, "uncalibrated": none, "summary": line}

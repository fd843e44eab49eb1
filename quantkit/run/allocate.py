"""--target-bits B / --target-size S: each quantized linear's bits and group size chosen from its measured sensitivity,
within a budget.

1. Sensitivity: the Fisher diagonal of every linear on the calibration windows (quantkit.calibration.sensitivity);
   a layer's predicted cost at a setting is ½ Σ F (W − Ŵ)², Ŵ its round-to-nearest weight at that setting. A method
   that rounds with GPTQ's error feedback gets each input column's cost scaled by the share the feedback leaves of
   it (quantkit.algorithms.gptq.feedback_gains, from the same windows' input Hessians): a layer whose inputs are
   correlated loses less to a coarse setting than its rounding error says. Behind --rotate hadamard all of it is
   taken in the rotated basis the method rounds in (`rotated`: W Πᵀ, the Fisher diagonal's block means, Π H Πᵀ).
2. Candidates: integer widths CANDIDATE_BITS x group sizes CANDIDATE_GROUPS (and the run's own), those the --compat
   target serves; a fused group (q/k/v, gate/up: vLLM runs it as one layer) takes one setting together. A codebook
   method (turboquant, e8, trellis) takes its rates instead, rates.CODEBOOK_BITS x the group sizes its quantizer
   takes; each rate's cost is its integer proxy's times the rate's measured factor (quantkit.run.rates).
3. Budget: the bits the checkpoint stores per weight of the quantized linears, codes, scales, zeros and g_idx counted
   as the codec writes them (Codec.layer_bits); the least summed cost within it, exactly (quantkit.core.knapsack).
   A size (--target-size) is the safetensors files' bytes: what the checkpoint stores besides those linears (every
   other tensor at the saved dtype, tensors carried as stored, and a bound on the headers: other_bytes) comes off
   first, the rest is the linears' budget.
   With --gguf-type auto the candidates are llama.cpp's block types instead, each layer those its rows hold whole
   blocks of, their bits the blocks' bytes; each type's cost is its integer proxy's scaled by what the type's own
   quantizer makes of sample rows (quantkit.gguf.auto); every linear chooses alone (llama.cpp runs q, k, v apart).
4. The allocation becomes the run's recipe: one `modules` override per linear, so that the recipe written to OUT
   reproduces it with --recipe, and a resumed run reads it back from its fingerprint instead of measuring again.
"""
import math
import re
from dataclasses import dataclass

import torch

from quantkit.algorithms.gptq import feedback_gains
from quantkit.algorithms.registry import method_spec
from quantkit.calibration.sensitivity import visit_fisher_diagonals
from quantkit.checkpoint.files import parse_size
from quantkit.checkpoint.shards import dtype_name
from quantkit.core import knapsack
from quantkit.core.errors import QuantkitError
from quantkit.gguf import auto as gguf_auto
from quantkit.gguf.export import GGUFSource, bytes_besides
from quantkit.models.arch import get_weight
from quantkit.run import rates
from quantkit.run.config import LayerSpec
from quantkit.run.precheck import skip_override
from quantkit.schemes.rotation import Rotation

CANDIDATE_BITS = (2, 3, 4, 8)
CANDIDATE_GROUPS = (32, 64, 128, -1)
SENSITIVITY_WINDOWS = 8  # calibration windows the Fisher pass reads (their first ones)
# A bound on the safetensors header bytes per tensor beyond its name: {"dtype":"F16","shape":[a,b],"data_offsets":
# [x,y]}, with up to 12 digits per number; per file, the 8-byte length, the metadata and the padding.
HEADER_PER_TENSOR, HEADER_PER_FILE = 96, 128
LAYER_TENSORS = 5  # the most tensors a codec writes per quantized linear (codes, scales, zeros, g_idx or shape, bias)


@dataclass(frozen=True)
class Setting:
    bits: int
    group_size: int
    sym: bool = True
    block_type: str | None = None  # a GGUF block type (--gguf-type auto); bits, group_size, sym: its integer proxy

    @property
    def name(self) -> str:
        return self.block_type or f"{self.bits}-bit g{self.group_size}"


def candidates(config, codec, specs: dict, shapes: dict, fused: dict) -> list[Setting]:
    """The settings a layer may take: the codec stores them and the --compat target serves them on every layer; with
    --gguf-type auto, llama.cpp's block types (quantkit.gguf.auto: each layer those its rows hold whole blocks of)."""
    if config.gguf_type == "auto":
        return [Setting(*gguf_auto.proxy(t), block_type=t) for t in gguf_auto.AUTO_TYPES]
    groups = sorted({*CANDIDATE_GROUPS, config.group_size}, key=lambda g: (g == -1, g))
    if config.quantizer != "int":  # the quantkit format holds any rate; its readers warn alike for every one
        return [Setting(b, g, config.sym) for b in rates.CODEBOOK_BITS for g in groups
                if rates.codebook_quantizer(config, b, g) is not None]
    out = []
    for setting in (Setting(b, g, config.sym) for b in CANDIDATE_BITS for g in groups):
        uniform = {n: LayerSpec(setting.bits, setting.group_size, config.sym) for n, s in specs.items() if s is not None}
        refused = [p for p in codec.compat_problems(config, uniform, shapes, fused)
                   if p.fatal and config.compat in ("any", p.reader)]
        if not refused:
            out.append(setting)
    if not out:
        raise QuantkitError(f"--target-bits: no candidate setting passes --compat {config.compat} "
                            f"(bits {CANDIDATE_BITS}, group sizes {groups}): drop --compat or choose the bits yourself")
    return out


@dataclass
class Allocation:
    picked: dict   # {quantized linear: its Setting}
    costs: dict    # {quantized linear: {Setting: predicted KL divergence per token}}

    @property
    def predicted_kld(self) -> float:
        return sum(self.costs[n][s] for n, s in self.picked.items())


def allocate(config, codec, source, specs: dict, shapes: dict, fused: dict, ids, device, other=0) -> Allocation:
    """Each quantized linear's Setting: config's target met at the least predicted cost; other: the bytes the files
    hold besides the quantized linears (other_bytes), what a --target-size leaves them."""
    names = [n for n, s in specs.items() if s is not None]
    settings = candidates(config, codec, specs, shapes, fused)
    groups = _groups(names, {} if config.gguf_type else fused)  # llama.cpp runs q, k and v as three tensors
    sizes = [[_sum_or_none(stored_bits(codec, s, shapes[n], config) for n in g) for s in settings] for g in groups]
    weights = sum(shapes[n][0] * shapes[n][1] for n in names)
    budget = (8 * (parse_size(config.target_size) - other) if config.target_size is not None
              else int(config.target_bits * weights))
    unfit = next((g for g, row in zip(groups, sizes) if all(x is None for x in row)), None)
    if unfit is not None:  # name the member that does not fit (q of a fused q/k/v group may, k not)
        name = next(n for n in unfit if stored_bits(codec, settings[0], shapes[n], config) is None)
        raise QuantkitError(_unfit(config, settings[0], name, shapes[name]))
    least = sum(min(x for x in row if x is not None) for row in sizes)
    if least > budget:  # refused before the sensitivity pass
        raise QuantkitError(_too_small(config, least, weights, other))
    costs = predicted_costs(source, names, settings, config, ids[:SENSITIVITY_WINDOWS], device)
    chosen = knapsack.solve([[sum(costs[n][j] for n in g) for j in range(len(settings))] for g in groups], sizes,
                            budget)
    if chosen is None:  # only the smallest settings fit, and the knapsack's units (sizes rounded up) do not
        raise QuantkitError(f"{config.target} leaves no room above the smallest settings "
                            f"({least / weights:.3f} bits per weight): ask for a little more")
    return Allocation({n: settings[j] for g, j in zip(groups, chosen) for n in g},
                      {n: dict(zip(settings, row)) for n, row in costs.items()})


def stored_bits(codec, setting: Setting, shape: tuple, config) -> int | None:
    """The bits a layer of shape (in, out) stores at `setting` (scales, zeros, g_idx counted), None if it cannot."""
    if setting.block_type is not None:
        return gguf_auto.stored_bits(setting.block_type, *shape)
    if config.quantizer != "int":
        quantizer = rates.codebook_quantizer(config, setting.bits, setting.group_size)
        return rates.layer_bits(quantizer, setting.group_size, config.rotate != "none", *shape)
    return codec.layer_bits(setting.bits, setting.group_size, setting.sym, *shape)


def _sum_or_none(values):
    values = list(values)
    return None if None in values else sum(values)


def _unfit(config, setting: Setting, name: str, shape: tuple) -> str:
    """The error for a linear that no candidate can hold, with the recipe override that keeps it in float."""
    if setting.block_type is not None:
        why = f"its rows ({shape[0]} inputs) are not whole blocks of any candidate type (32 inputs each)"
    else:
        quantizer = rates.codebook_quantizer(config, setting.bits, setting.group_size)
        why = rates.misfit(quantizer, setting.group_size, *shape)
    return (f"{config.target}: {name}: {why}. Keep such layers in floating point with a recipe override (modules: - "
            f"pattern: '{skip_override([name])['pattern']}' skip: true)")


def _too_small(config, least: int, weights: int, other: int) -> str:
    if config.target_size is None:
        return (f"{config.target}: the smallest candidate of every layer already stores {least / weights:.3f} bits per "
                f"weight (scales, zeros and g_idx counted): ask for at least "
                f"{math.ceil(least / weights * 1000) / 1000:.3f}")
    need = other + math.ceil(least / 8)
    return (f"{config.target}: the tensors kept in float take {other / 1e6:.3f} MB and the quantized linears at their "
            f"smallest setting {least / 8e6:.3f} MB: ask for at least {math.ceil(need / 1e3) / 1e3:.3f}MB")


def other_bytes(source, quantized: list, save_dtype) -> int:
    """What the checkpoint's safetensors files hold besides the quantized linears' tensors, in bytes (an upper bound):
    every other tensor of the model at save_dtype (floats; others as they are), each tensor carried unchanged as
    stored (multi-token-prediction layers), and the header entries of all of them and of the linears' own tensors."""
    weights = {f"{n}.weight" for n in quantized}
    state = source.model.state_dict(keep_vars=True)
    total = sum(len(n) + HEADER_PER_TENSOR + LAYER_TENSORS * (len(n) + 24 + HEADER_PER_TENSOR) for n in quantized)
    for n in source.names:
        if n not in weights:
            t = state[n]
            size = torch.empty((), dtype=save_dtype if t.is_floating_point() else t.dtype).element_size()
            total += t.numel() * size + len(n) + HEADER_PER_TENSOR
    total += sum(nbytes + len(n) + HEADER_PER_TENSOR for n, nbytes in stored_bytes(source, source.unloaded).items())
    return total + HEADER_PER_FILE * (1 + len(set(source.files.values())))


def gguf_other_bytes(source, quantized: list, save_dtype, tokenizer, name: str, in_files) -> int:
    """What model.gguf holds besides the quantized linears' blocks, in bytes (an upper bound; quantkit.gguf.export):
    its metadata and tokenizer, every tensor's entry, every other tensor as the file stores it, the padding."""
    weights = {f"{n}.weight" for n in quantized}
    state = source.model.state_dict(keep_vars=True)
    floats = {in_files.of_tensor(n): (dtype_name(save_dtype if state[n].is_floating_point() else state[n].dtype),
                                      list(state[n].shape)) for n in source.names if n not in weights}
    linears = {in_files.of_module(n): tuple(state[f"{n}.weight"].shape) for n in quantized}
    return bytes_besides(GGUFSource(source.model.config.to_dict(), tokenizer, name, {}, "auto"), floats, linears)


def stored_bytes(source, names) -> dict:
    """{name: bytes} of tensors of the source's files, read off the safetensors headers."""
    from safetensors import safe_open

    out = {}
    for fname in sorted({source.files[n] for n in names}):
        with safe_open(source.folder / fname, framework="pt") as f:
            for n in (n for n in names if source.files[n] == fname):
                piece = f.get_slice(n)
                out[n] = math.prod(piece.get_shape()) * DTYPE_BYTES[piece.get_dtype()]
    return out


DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def as_overrides(allocation: Allocation) -> list[dict]:
    """The recipe `modules` entries that give each linear its Setting (exact names; a fused group's members each)."""
    return [{"pattern": f"^{re.escape(n)}$", **({"block_type": s.block_type} if s.block_type else
                                                 {"bits": s.bits, "group_size": s.group_size}), "split_fused": True}
            for n, s in allocation.picked.items()]


def predicted_costs(source, names, settings, config, ids, device) -> dict:
    """{linear: [predicted KL divergence per token at each setting]}: ½ Σ F (W − Ŵ)² with Ŵ rounded to nearest, each
    input column's share scaled by what GPTQ's feedback leaves of it when the method rounds with GPTQ."""
    out = {}
    feedback = method_spec(config.method).rounding == "gptq"
    factors, key = None, None  # what scales the integer proxy's cost to a GGUF type's or a codebook rate's
    if config.gguf_type == "auto":
        proxies = {s.block_type: s for s in settings}
        factors = gguf_auto.TypeFactors(lambda w, t: rounding_error(w, proxies[t], proxies[t].sym))
        key = (lambda s: s.block_type)
    elif config.quantizer != "int":
        factors, key = rates.RateFactors(config, lambda w, s: rounding_error(w, s, True)), (lambda s: s)
    gains = {}  # {input Hessian: its feedback gains}: q, k and v read one

    def per_layer(name, module, fisher, hessian):
        w = get_weight(module).detach().float()
        if config.rotate != "none":  # the method rounds W Πᵀ: its error, Fisher diagonal and feedback in that basis
            w, fisher, hessian = rotated(name, w, fisher, hessian, config.seed)
        if hessian is not None:
            if hessian not in gains:
                gains[hessian] = feedback_gains(hessian, config.damp, config.act_order)
            fisher = fisher * gains[hessian]
        out[name] = [0.5 * float((fisher * rounding_error(w, s, s.sym)).sum())
                     if s.block_type is None or gguf_auto.fits(s.block_type, w.shape[1]) else math.inf
                     for s in settings]
        if factors is not None:
            factors.add(w)
    visit_fisher_diagonals(source, names, ids, per_layer, device, hessians=feedback)
    if factors is not None:  # each setting's proxy error scaled to what its own quantizer makes
        out = {n: [c * factors.factor(key(s)) for c, s in zip(row, settings)] for n, row in out.items()}
    return out


def rotated(name: str, w: torch.Tensor, fisher: torch.Tensor, hessian, seed: int) -> tuple:
    """(W Πᵀ, the Fisher diagonal in the rotated basis, Π H Πᵀ) for the layer's own rotation Π, as the method draws
    it."""
    rotation = Rotation.for_layer(name, w.shape[1], seed)
    return (rotation.rotate_weight(w), rotation.rotate_diagonal(fisher),
            rotation.rotate_hessian(hessian) if hessian is not None else None)


def rounding_error(w: torch.Tensor, setting: Setting, sym: bool) -> torch.Tensor:
    """(w − Ŵ)² [out, in] of round-to-nearest on the integer grid, all groups at once: the max-abs scale (symmetric)
    or the min/max range (asymmetric) of each group. The run's quantizer picks between scales per group and GPTQ
    feeds errors back, so the real error is smaller; the estimate ranks the settings and layers, which is its use."""
    rows, cols = w.shape
    size = cols if setting.group_size == -1 else min(setting.group_size, cols)
    pad = (-cols) % size
    g = torch.nn.functional.pad(w, (0, pad)).view(rows, -1, size)  # a short last group padded with zeros
    maxq = 2 ** setting.bits - 1
    if sym:
        scale = (2 * g.abs().amax(-1, keepdim=True) / maxq).clamp(min=1e-12)
        zero = torch.full_like(scale, 2 ** (setting.bits - 1))
    else:
        low, high = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
        scale = ((high - low) / maxq).clamp(min=1e-12)
        zero = (-low / scale).round()
    rounded = ((g / scale).round() + zero).clamp(0, maxq).sub(zero).mul(scale)
    return (g - rounded).square().view(rows, -1)[:, :cols]


def _groups(names: list, fused: dict) -> list[tuple]:
    """The allocation's items: each fused group whole, every other linear alone, in the order of `names`."""
    group_of = {m: tuple(members) for members in fused.values() for m in members}
    seen, out = set(), []
    for n in names:
        group = tuple(m for m in group_of.get(n, (n,)) if m in names)
        if group[0] not in seen:
            seen.add(group[0])
            out.append(group)
    return out


def summary(allocation: Allocation, shapes: dict, codec, config, other: int = 0) -> list[str]:
    """Lines that say what was chosen: the bits stored per weight (and, for a size, the files' bytes at most), and
    per module kind the settings' histogram and its share of the stored bits."""
    target = config.target
    by_kind, total_bits, total_weights = {}, 0, 0
    for name, s in allocation.picked.items():
        stored, weights = stored_bits(codec, s, shapes[name], config), shapes[name][0] * shapes[name][1]
        entry = by_kind.setdefault(module_kind(name), {"mix": {}, "stored": 0, "weights": 0})
        key = s.name
        entry["mix"][key] = entry["mix"].get(key, 0) + 1
        entry["stored"], entry["weights"] = entry["stored"] + stored, entry["weights"] + weights
        total_bits, total_weights = total_bits + stored, total_weights + weights
    lines = [f"{target}: {total_bits / total_weights:.3f} bits per weight stored in the quantized "
             f"linears ({total_bits / 8 / 2**20:.2f} MiB), predicted KL divergence {allocation.predicted_kld:.4g} "
             "nats per token"]
    if config.target_size is not None:
        files = "model.gguf" if config.gguf_type else "safetensors files"
        lines.append(f"  {files} of at most {(other + total_bits / 8) / 1e6:.3f} MB (asked: "
                     f"{parse_size(config.target_size) / 1e6:.3f} MB), {other / 1e6:.3f} MB of them kept in float")
    for kind, e in sorted(by_kind.items()):
        mix = ", ".join(f"{k} x{v}" for k, v in sorted(e["mix"].items()))
        lines.append(f"  {kind:<16} {e['stored'] / e['weights']:.2f} bits per weight, {e['stored'] / total_bits:5.1%} "
                     f"of the bits: {mix}")
    return lines


def report(allocation: Allocation, lines: list, config, of_module) -> dict:
    """The report's "target_bits" entry: the target (bits per weight, or "size" in bytes), the lines, and every layer's
    predicted cost per setting (what scripts/bench_target_bits.py checks the prediction with), under the layers'
    names in the files."""
    target = ({"size": parse_size(config.target_size)} if config.target_size is not None
              else {"target": config.target_bits})
    return {**target, "predicted_kld": allocation.predicted_kld, "summary": lines,
            "costs": {of_module(n): {s.name: c for s, c in row.items() if math.isfinite(c)}
                      for n, row in allocation.costs.items()}}


def module_kind(name: str) -> str:
    """A linear's kind for the summary: its last name component, `experts.` kept (experts may take fewer bits)."""
    leaf = name.rpartition(".")[2]
    return f"experts.{leaf}" if ".experts." in name else leaf

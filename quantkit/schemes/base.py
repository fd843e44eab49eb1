"""The quantizer protocol: what every rounding scheme offers the methods, which never name a grid.

A quantizer rounds `width` consecutive input columns together (1 for scalar grids and scalar
codebooks, 8 for an E8 lattice) with parameters fitted per row and per group of input columns:

    name        registry key, recorded in quantkit-format checkpoints ("int" for the integer grid)
    width       columns rounded as one unit; divides the group size and the layer's input width
    code_bits   bits per code per column (what a generic packer spends)
    param_bits  {parameter: bits stored per row and group}, e.g. {"scale": 16} (16: stored as fp16, else fp32)
    settings()  the constructor arguments, e.g. {"bits": 4, "sym": True}: enough to rebuild it
    from_spec(bits, sym, group_size)   classmethod: the quantizer a layer's settings ask for (each takes
                what applies to it: the integer grid bits and sym, TurboQuant bits and its block d)
    fit(w, importance=None) -> params {key: [rows]}      one group's parameters, w [rows, cols]; importance
                                                         [cols], if given, weighs each column's rounding error
                                                         (GPTQ's Hessian diagonal; a quantizer may ignore it)
    span        optional: groups fitted together (default 1). A quantizer whose groups share a step (llama.cpp's
                k-quants: 8 or 16 sub-blocks under one fp16 step) sets it; its fit then takes span groups' columns
                and returns {key: [rows, span]}. fit_groups / fit_all hide the difference from the methods.
    round(w, params)        -> (codes, dequantized)      w [rows, k * width], params {key: [rows]}
    weighted_round  optional: True when round also takes importance= [k * width], each column's weight in the
                    unit's distance (a unit wider than one column is not rounded column by column, so the weights
                    change its point; GPTQ passes them)
    dequantize(codes, p)    -> weights                   p gathered per column: {key: [rows, cols]}
    kernel_decode           a KernelDecode, or None: how the codebook GEMM decodes its codes in registers
                            (quantkit.kernels.codebook); without one a loaded layer decodes through dequantize

RTN (quantkit.algorithms.rtn) is fit + round per group; GPTQ (quantkit.algorithms.gptq) rounds one unit
at a time with error feedback; AWQ's scale search calls fake_quantize. A new quantizer is one file in this
package: a class decorated with `@register_quantizer` (quantkit.schemes imports every module here), and, if it is
also a method of its own behind a Hadamard rotation (as turboquant and e8 are), `offer_method(name)`.
"""
from dataclasses import dataclass

import torch

from quantkit.core.errors import QuantkitError
from quantkit.core.groups import group_width, n_groups
from quantkit.core.registry import Registry

QUANTIZERS = Registry("quantizer")
# Names a run may give (--quantizer, a method's default) that pick a quantizer class by the settings instead of
# naming one, e.g. "e8": the best E8 codebook per width. A checkpoint records the class's own name.
SPEC_NAMES = Registry("quantizer name")
SPEC_SUMMARIES = {}
# Quantizer names that are methods too: --method NAME rounds to nearest with that quantizer behind a Hadamard
# rotation, NAME+gptq inside GPTQ's error feedback (quantkit.algorithms.method).
METHOD_QUANTIZERS = {}  # {name: what the method does, for --method's help}

register_quantizer = QUANTIZERS.decorator("name")


SPEC_METHODS = {}  # {spec name: the quantizer method whose --method NAME / NAME+gptq also takes it as --quantizer}


def register_spec_name(name: str, factory, summary: str, method=None):
    """`--quantizer name` builds factory(bits, sym, group_size); summary: one line of help; method: a quantizer
    method (offer_method) whose runs may take this name instead of their own (another setting of the same
    quantizer, e.g. trellis-l16 for --method trellis+gptq)."""
    SPEC_NAMES.add(name, factory)
    SPEC_SUMMARIES[name] = summary
    if method is not None:
        SPEC_METHODS[name] = method


def serves_method(name: str, implied: str) -> bool:
    """Whether --quantizer `name` may stand in a run whose method rounds with `implied`."""
    return name == implied or SPEC_METHODS.get(name) == implied


def is_method_quantizer(name: str) -> bool:
    """Whether --quantizer `name` is one of the codebooks that offer methods (offer_method), or a setting of one."""
    return name in METHOD_QUANTIZERS or SPEC_METHODS.get(name) in METHOD_QUANTIZERS


def offer_method(name: str, summary: str) -> None:
    """Make --method name and name+gptq exist for the quantizer (or spec name) `name`; summary: what its
    rounding is, for the help ("Lloyd-Max codebook per block")."""
    METHOD_QUANTIZERS[name] = summary


@dataclass(frozen=True)
class KernelDecode:
    """What the codebook dequant-GEMM (quantkit.kernels.codebook) needs to decode a quantizer's codes in
    registers: w = scale * value(code), value by `variant`:
      "table"    value = table[code], `table` the 2^bits float levels (TurboQuant)
      "lattice"  every 8 consecutive codes along K are one box-truncated E8 point with this `offset`
      "e8p"      every 8 codes are one E8P word, `table` its int32 tables, the residual stage divided by `ratio`
      "trellis"  a weight's value is computed from its state in a tail-biting sequence (quantkit.schemes.trellis):
                 `trellis` = (state_bits, step, code, tile_rows, length), `table` hyb's (x, y) pairs flattened
    """
    variant: str
    table: tuple = ()
    offset: float = 0.0
    ratio: float = 1.0
    trellis: tuple = ()

    @property
    def unit_local(self) -> bool:
        """A unit's values depend on its own codes only: what the fused GEMM's tiles and the CPU's table lookups
        assume. A trellis state spans its sequence (a tile of rows): decoded whole, then multiplied."""
        return self.variant != "trellis"


@dataclass(frozen=True)
class OneType:
    """Base of a quantizer that makes exactly one of llama.cpp's block types: its bits (`type_bits`) and its group
    (`type_group`) are the type's, so its settings are {"bits"} and the run's --bits / --group-size are checked."""
    bits: int

    def __post_init__(self):
        if self.bits != self.type_bits:
            raise QuantkitError(f"the {self.name} quantizer makes llama.cpp's {self.ggml_type}, {self.type_bits} bits: "
                                f"use --bits {self.type_bits} (got {self.bits!r})")

    @classmethod
    def from_spec(cls, bits: int, sym: bool, group_size: int):
        if group_size != cls.type_group:
            raise QuantkitError(f"the {cls.name} quantizer makes llama.cpp's {cls.ggml_type}, {cls.type_bits} bits in "
                                f"groups of {cls.type_group}: use --bits {cls.type_bits} --group-size {cls.type_group} "
                                f"(got --group-size {group_size})")
        return cls(bits)

    def settings(self) -> dict:
        return {"bits": self.bits}


def param_dtype(quantizer, key: str) -> torch.dtype:
    """How a quantizer's per-group parameter is stored: fp16 when it spends 16 bits on it, else float32."""
    return torch.float16 if quantizer.param_bits[key] == 16 else torch.float32


def quantizer_names() -> list:
    """Every name --quantizer takes."""
    return sorted(set(QUANTIZERS) | set(SPEC_NAMES))


def quantizer_help() -> str:
    """One line per --quantizer name, from the registries."""
    summaries = {**{name: getattr(cls, "summary", "") for name, cls in QUANTIZERS.items()}, **SPEC_SUMMARIES}
    return "; ".join(f"{name}: {summaries[name]}" for name in quantizer_names())


def make_quantizer(name: str, **settings):
    """A quantizer from its recorded settings (a checkpoint's layer entry)."""
    return QUANTIZERS.get_entry(name)(**settings)


def quantizer_for(name: str, bits: int, sym: bool, group_size: int):
    """The quantizer a layer's run settings ask for (--quantizer, --bits, --sym, --group-size)."""
    if name in SPEC_NAMES:
        return SPEC_NAMES[name](bits, sym, group_size)
    return QUANTIZERS.get_entry(name).from_spec(bits, sym, group_size)


def fit_groups(quantizer, w: torch.Tensor, importance=None) -> dict:
    """{key: [rows, n]}: the parameters of the n groups that w [rows, cols] covers: one group, or one span of the
    quantizer's `span` groups fitted together."""
    fitted = quantizer.fit(w, importance=importance)
    return fitted if getattr(quantizer, "span", 1) > 1 else {k: v[:, None] for k, v in fitted.items()}


def fit_all(quantizer, w: torch.Tensor, group_size: int, importance=None) -> dict:
    """{key: [rows, n_groups]} of every group of w [rows, cols] (a span at a time), each fitted on a row-major copy
    of its columns; importance [cols], if given, passed on per group."""
    rows, cols = w.shape
    size = group_width(cols, group_size)
    step = size * getattr(quantizer, "span", 1)
    params = {}
    for c0 in range(0, cols, step):
        imp = None if importance is None else importance[c0:c0 + step]
        for key, value in fit_groups(quantizer, w[:, c0:c0 + step].contiguous(), imp).items():
            g = c0 // size
            params.setdefault(key, torch.zeros(rows, n_groups(cols, group_size), dtype=torch.float32,
                                               device=w.device))[:, g:g + value.shape[1]] = value
    return params


def fake_quantize(w: torch.Tensor, quantizer, group_size: int, bounds=None) -> torch.Tensor:
    """Round-to-nearest of w [rows, cols] group by group, dequantized, float32, vectorised over groups.

    Columns are zero-padded to whole groups (a scalar grid's range always holds 0 and decodes padding
    back to exact zeros; other quantizers see a few zero columns in the last group only when it is short).
    bounds [rows, n_groups, 2] (lo, hi), if given, clamps each group first (AWQ's clip search).
    """
    w = w.float()
    rows, cols = w.shape
    size, ng = group_width(cols, group_size), n_groups(cols, group_size)
    wg = torch.nn.functional.pad(w, (0, ng * size - cols)).view(rows, ng, size)
    if bounds is not None:
        wg = torch.clamp(wg, bounds[..., :1], bounds[..., 1:])
    span = getattr(quantizer, "span", 1)  # whole spans: check_shape holds the layer to them
    params = fit_groups(quantizer, wg.reshape(rows * ng // span, size * span))
    _, wq = quantizer.round(wg.reshape(rows * ng, size), {k: v.reshape(-1) for k, v in params.items()})
    return wq.view(rows, ng * size)[:, :cols]

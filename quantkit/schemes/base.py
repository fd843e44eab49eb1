"""The quantizer protocol: what every rounding scheme offers the methods, which never name a grid.

A quantizer rounds `width` consecutive input columns together (1 for scalar grids and scalar
codebooks, 8 for an E8 lattice) with parameters fitted per row and per group of input columns:

    name        registry key, recorded in quantkit-format checkpoints ("int" for the integer grid)
    width       columns rounded as one unit; divides the group size and the layer's input width
    code_bits   bits per code per column (what a generic packer spends)
    settings()  the constructor arguments, e.g. {"bits": 4, "sym": True}: enough to rebuild it
    from_spec(bits, sym, group_size)   classmethod: the quantizer a layer's settings ask for (each takes
                what applies to it: the integer grid bits and sym, TurboQuant bits and its block d)
    fit(w, importance=None) -> params {key: [rows]}      one group's parameters, w [rows, cols]; importance
                                                         [cols], if given, weighs each column's rounding error
                                                         (GPTQ's Hessian diagonal; a quantizer may ignore it)
    round(w, params)        -> (codes, dequantized)      w [rows, k * width], params {key: [rows]}
    dequantize(codes, p)    -> weights                   p gathered per column: {key: [rows, cols]}

RTN (quantkit.algorithms.rtn) is fit + round per group; GPTQ (quantkit.algorithms.gptq) rounds one unit
at a time with error feedback; AWQ's scale search calls fake_quantize. A new quantizer is one class
here-and-registered (`@register_quantizer`) plus, if it needs a fast kernel, a module in a codec.
"""
import torch

from quantkit.core.errors import QuantkitError
from quantkit.core.groups import group_width, n_groups
from quantkit.schemes.e8 import E8Box
from quantkit.schemes.e8p import E8P
from quantkit.schemes.grid import Grid
from quantkit.schemes.turboquant import TurboQuant

QUANTIZERS = {}


def register_quantizer(cls):
    """Class decorator: make `cls` buildable by name (make_quantizer) and so loadable from a checkpoint."""
    QUANTIZERS[cls.name] = cls
    return cls


register_quantizer(Grid)
register_quantizer(TurboQuant)
register_quantizer(E8Box)
register_quantizer(E8P)


def best_e8(bits: int, sym: bool, group_size: int):
    """What `--quantizer e8` (the e8 methods' default) means: the E8 codebook with the least MSE at this width,
    measured on unit Gaussians and rotated SmolLM2 rows (docs/QUALITY.md): E8P at 2, 3 and 4 bits, the
    box-truncated E8 at 1 bit (E8P has no 1-bit form)."""
    return (E8P if bits in (2, 3, 4) else E8Box).from_spec(bits, sym, group_size)


# Names a run may give (--quantizer, a method's default) that pick a quantizer class by the settings instead of
# naming one: "e8" the best E8 codebook per width, "e8box" the box-truncated E8 at any width. A checkpoint
# records the class's own name: "e8" (the box, as before E8P existed) or "e8p".
SPEC_NAMES = {"e8": best_e8, "e8box": E8Box.from_spec}


def quantizer_names() -> list:
    """Every name --quantizer takes."""
    return sorted(set(QUANTIZERS) | set(SPEC_NAMES))


def _class(name: str):
    if name not in QUANTIZERS:
        raise QuantkitError(f"unknown quantizer {name!r}: this version knows {', '.join(sorted(QUANTIZERS))}")
    return QUANTIZERS[name]


def make_quantizer(name: str, **settings):
    """A quantizer from its recorded settings (a checkpoint's layer entry)."""
    return _class(name)(**settings)


def quantizer_for(name: str, bits: int, sym: bool, group_size: int):
    """The quantizer a layer's run settings ask for (--quantizer, --bits, --sym, --group-size)."""
    if name in SPEC_NAMES:
        return SPEC_NAMES[name](bits, sym, group_size)
    return _class(name).from_spec(bits, sym, group_size)


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
    flat = wg.reshape(rows * ng, size)
    _, wq = quantizer.round(flat, quantizer.fit(flat))
    return wq.view(rows, ng * size)[:, :cols]

"""--gguf-type auto: each tensor's llama.cpp block type chosen for a budget (--target-bits, --target-size), as
quantkit.run.allocate chooses integer settings: the candidates here, what each stores, and how its rounding error is
estimated.

A type's error on a layer is estimated as the integer grid's round-to-nearest error at the type's bits, sub-block and
symmetry (fast, every weight, weighted by the Fisher diagonal), times one factor per type: what the type's own
quantizer (llama.cpp's searched scales, 6-bit sub-scales, IQ4_NL's non-uniform grid) makes of sample rows against
that proxy on the same rows. Running the real quantizers on every weight would be exact but slow: Q2_K's scale search
costs ~25 s per million weights on this project's 2-core VM.
"""
import torch

from quantkit.algorithms.rtn import rtn
from quantkit.gguf.types import TYPES, settings_of_type
from quantkit.schemes.base import quantizer_for

# The types a layer may get: the k-quants and IQ4_XS where rows are whole super-blocks of 256, the types of blocks of
# 32 (IQ4_NL's non-uniform grid among them) everywhere. IQ2_XXS and IQ3_XXS are left out: GPTQ through their lattice
# searches takes 2-3x as long (SmolLM2's IQ3_XXS file: 8 min 49 s against Q2_K's 2 min 56 s), which a budget should
# not impose unasked.
AUTO_TYPES = ("Q2_K", "Q3_K", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "IQ4_NL", "Q5_0", "Q5_1", "Q8_0")
SAMPLE_ROWS = 8  # rows taken from each layer for the factors
SAMPLE_WEIGHTS = 1 << 16  # weights each type's own quantizer runs on (evenly drawn from all layers' sample rows)


def evenly(rows: torch.Tensor, count: int) -> torch.Tensor:
    """`count` of the rows (at most all), evenly spaced from the first to the last: the factors' samples."""
    return rows[torch.linspace(0, len(rows) - 1, min(count, len(rows))).long()]


def fits(block_type: str, in_features: int) -> bool:
    return in_features % TYPES[block_type].block == 0


def stored_bits(block_type: str, in_features: int, out_features: int) -> int | None:
    """The bits a layer of this type stores (its blocks), None when its rows are not whole blocks."""
    kind = TYPES[block_type]
    return out_features * in_features // kind.block * kind.block_bytes * 8 if fits(block_type, in_features) else None


def proxy(block_type: str) -> tuple[int, int, bool]:
    """(bits, group size, symmetric) of the integer grid that stands in for the type."""
    s = settings_of_type(block_type)
    return s["bits"], s["group_size"], s["sym"]


def quantizer(block_type: str):
    s = settings_of_type(block_type)
    return quantizer_for(s["quantizer"], s["bits"], s["sym"], s["group_size"]), s["group_size"]


class TypeFactors:
    """Each type's own squared error over its proxy's on the same sample weights. Blocks never cross a row, so sample
    rows are cut into rows of 256 (or of 32, where a layer's rows are not whole super-blocks) and pooled across
    layers: each type's quantizer runs once, on SAMPLE_WEIGHTS of them."""

    def __init__(self, proxy_error):
        self.proxy_error = proxy_error  # (w [rows, in], block_type) -> (w − ŵ)² of the proxy grid
        self.pools = {256: [], 32: []}
        self.factors = None

    def add(self, w: torch.Tensor) -> None:
        width = next((b for b in self.pools if w.shape[1] % b == 0), None)
        if width is not None:
            rows = evenly(w, SAMPLE_ROWS)
            self.pools[width].append(rows.reshape(-1, width))

    def factor(self, block_type: str) -> float:
        if self.factors is None:
            self.factors = {t: self._measure(t) for t in AUTO_TYPES}
        return self.factors[block_type]

    def _measure(self, block_type: str) -> float:
        block = TYPES[block_type].block
        pieces = [p.reshape(-1, block) for width, pool in self.pools.items() if width % block == 0 for p in pool]
        if not pieces:
            return 1.0
        rows = torch.cat(pieces)
        rows = evenly(rows, SAMPLE_WEIGHTS // block)
        q, group_size = quantizer(block_type)
        real = float((rtn(rows, q, group_size).dequantize() - rows).square().sum())
        proxy = float(self.proxy_error(rows, block_type).sum())
        return real / proxy if proxy > 0 else 1.0

"""The bitshift trellis of QTIP (Tseng et al., 2024, arXiv 2406.11235): its states, its codes, and the value of a state.

A sequence of T weights is n = T / V steps of V weights. Step t writes one symbol b_t of kV bits (k bits per
weight); the state is the last L bits written, newest symbol lowest:

    s_t = ((s_(t-1) << kV) | b_t) mod 2^L          (so s_t = Σ_j b_(t-j) << kVj, mod 2^L)

and the step's V weights decode as value(s_t), a V-vector computed from the state alone (no stored codebook of 2^L
entries). Tail-biting: the stream is circular, the symbols before b_0 are the sequence's last ones (b_(-j) = b_(n-j)),
so a sequence of T weights costs exactly k·T bits and its first state needs no extra bits.

Codes per column (what quantkit stores: k bits per weight, packed as any k-bit codes): column V·t + v holds bits
[k·v, k·v + k) of b_t. A decoder reading the packed stream gets each state as the window of its last ceil(L / kV)
symbols (states_of_codes, torch ops over whole layers); on the CPU values_of_codes walks each tile in C instead
(trellis_decode.c: the same states and table, one symbol shifted in a step).

The value of a state (`code`), each normalized to about N(0, 1) per coordinate:
  1mad   QTIP's "1MAD": x = (a·s + b) mod 2^32 with a = 34038481, b = 76625530; the sum of x's 4 bytes (mean 510,
         std 147.8 for uniform bytes), centred and divided by 147.800537109375 (QTIP's constant). V = 1 as in QTIP;
         V = 2 (quantkit's extension) takes the second coordinate from the next LCG iterate x' = (a·x + b) mod 2^32.
  3inst  QTIP's "3INST": x = (a·s + b) mod 2^32 with a = 89226354, b = 64248484; y = (x AND 0x8FFF8FFF) XOR
         0x3B603B60 is two fp16 bit patterns (sign and mantissa from x, exponent forced to 12..15); the value is
         their sum in fp16, times THREE_INST_GAIN in float32 (1 / the sum's std for uniform bits, quantkit's
         normalization). V = 2 as for 1mad: the next LCG iterate gives the second coordinate.
  hyb    QTIP's "HYB" (V = 2 only): h = s·(s + 1) mod 2^32; the Q bits of h below bit L-1 index a table of 2^Q
         2-vectors, and bit L-1 of h flips the sign of the first coordinate. QTIP fixes L = 16 (bits 6..14, sign bit
         15); quantkit keeps the same bits relative to L. The table is stored with the layer (the default,
         sunflower_table: equal-mass points of the 2-D unit Gaussian).
"""
import ctypes
import math
from functools import cache, lru_cache
from pathlib import Path
from typing import Optional

import torch

from quantkit.core import native

CODES = ("1mad", "3inst", "hyb")
MAD = (34038481, 76625530)        # 1MAD's LCG (multiplier, increment)
INST = (89226354, 64248484)       # 3INST's LCG
INST_MASK, INST_XOR = 0x8FFF8FFF, 0x3B603B60
# 3INST's halves are ±(1 + m/1024)·2^(e-15), e uniform in 12..15, m in 0..1023: E[half²] = 1.328125/4 · 2.331871...,
# the sum of two has variance 1.548484 (std 1.244381)
THREE_INST_GAIN = 1 / 1.244381
MAD_CENTRE, MAD_STD = 510, 147.800537109375
WORD = (1 << 32) - 1


def _lcg(x: torch.Tensor, lcg) -> torch.Tensor:
    """(a·x + b) mod 2^32, in int64 (exact: a < 2^27 and x < 2^32, so a·x + b < 2^60)."""
    return (x * lcg[0] + lcg[1]) & WORD


def _one_mad(x: torch.Tensor) -> torch.Tensor:
    """The byte sum of a 32-bit word, centred and scaled to std ~1 (float32)."""
    total = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + ((x >> 24) & 255)
    return (total - MAD_CENTRE).to(torch.float32) / MAD_STD


def _fp16_of(bits16: torch.Tensor) -> torch.Tensor:
    """The float16 whose bit pattern is bits16 (int64 in 0..65535)."""
    return torch.where(bits16 >= 1 << 15, bits16 - (1 << 16), bits16).to(torch.int16).view(torch.float16)


def _three_inst(x: torch.Tensor) -> torch.Tensor:
    """Two fp16 bit patterns built from the word x, summed in fp16, scaled in float32."""
    y = (x & INST_MASK) ^ INST_XOR
    total = _fp16_of(y >> 16) + _fp16_of(y & 0xFFFF)  # fp16 + fp16 rounds to fp16: what an fp16 decoder computes
    return total.to(torch.float32) * THREE_INST_GAIN


def computed_values(code: str, states: torch.Tensor, V: int) -> torch.Tensor:
    """[..., V] float32 values of 1mad / 3inst states (int64)."""
    lcg, fn = (MAD, _one_mad) if code == "1mad" else (INST, _three_inst)
    x, out = states.to(torch.int64), []
    for _ in range(V):
        x = _lcg(x, lcg)
        out.append(fn(x))
    return torch.stack(out, dim=-1)


def hyb_values(states: torch.Tensor, L: int, table: torch.Tensor) -> torch.Tensor:
    """[..., 2] float32 values of hyb states: a table row picked by bits of s·(s+1), the first coordinate's sign by
    bit L-1."""
    s = states.to(torch.int64)
    h = (s * (s + 1)) & WORD
    q = int(math.log2(table.shape[0]))
    index = (h >> (L - 1 - q)) & ((1 << q) - 1)
    flip = 1 - 2 * ((h >> (L - 1)) & 1).to(torch.float32)
    pair = table.to(torch.float32)[index]
    return torch.stack([pair[..., 0] * flip, pair[..., 1]], dim=-1)


def values(code: str, L: int, V: int, table=None, states=None) -> torch.Tensor:
    """[len(states), V] float32: the value of each state (every one of the 2^L states by default)."""
    states = torch.arange(1 << L) if states is None else states
    if code == "hyb":
        return hyb_values(states, L, torch.as_tensor(table, dtype=torch.float32))
    return computed_values(code, states, V)


@lru_cache(maxsize=4)
def sunflower_table(q: int = 9) -> tuple:
    """The default hyb table: 2^q equal-mass points of the 2-D unit Gaussian on a sunflower spiral (point i at radius
    sqrt(-2 ln(1 - (i + ½) / 2^q)), the Gaussian's radial quantile, and angle i times the golden angle), as a tuple of
    float32 (x, y) pairs. Uniform over the table it is close to N(0, I): what a trellis's state values should be (a
    k-means table puts too few points in the tails; measured, scripts/bench_distortion.py)."""
    n = 1 << q
    i = torch.arange(n, dtype=torch.float64)
    radius = torch.sqrt(-2 * torch.log1p(-(i + 0.5) / n))
    angle = i * math.pi * (3 - math.sqrt(5))
    pairs = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1).to(torch.float32)
    return tuple(tuple(p) for p in pairs.tolist())


def symbols_of_codes(codes: torch.Tensor, k: int, V: int) -> torch.Tensor:
    """[..., n] int64 step symbols from per-column codes [..., n·V] (column V·t + v holds bits [k·v, k·v + k))."""
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, V)
    return sum(c[..., v] << (k * v) for v in range(V))


def codes_of_symbols(symbols: torch.Tensor, k: int, V: int) -> torch.Tensor:
    """The inverse of symbols_of_codes: [..., n] symbols -> [..., n·V] int32 codes."""
    s = symbols.to(torch.int64)
    cols = [(s >> (k * v)) & ((1 << k) - 1) for v in range(V)]
    return torch.stack(cols, dim=-1).reshape(*s.shape[:-1], -1).to(torch.int32)


def states_of_symbols(symbols: torch.Tensor, L: int, kV: int) -> torch.Tensor:
    """[..., n] int64 states of a tail-biting sequence: s_t = Σ_j b_((t-j) mod n) << kVj, mod 2^L."""
    state = torch.zeros_like(symbols, dtype=torch.int64)
    for j in range(-(-L // kV)):
        state |= torch.roll(symbols.to(torch.int64), j, dims=-1) << (kV * j)
    return state & ((1 << L) - 1)


def states_of_codes(codes: torch.Tensor, L: int, k: int, V: int) -> torch.Tensor:
    """[..., n] int64 states of the tail-biting sequences whose per-column codes are codes [..., n·V]."""
    return states_of_symbols(symbols_of_codes(codes, k, V), L, k * V)


@cache
def native_decode():
    """The C decode (trellis_decode.c, built on first use by quantkit.core.native), or None where it cannot be
    built."""
    return native.function(Path(__file__).with_name("trellis_decode.c"), "trellis_decode",
                           [ctypes.c_int64] * 10 + [ctypes.c_void_p] * 3)


def values_of_codes(codes: torch.Tensor, table: torch.Tensor, L: int, k: int, V: int, tile_rows: int,
                    width: int) -> Optional[torch.Tensor]:
    """[rows, cols] float32: the state value of every weight of a layer's codes [rows, cols] (whole tiles of
    tile_rows x width, each a tail-biting sequence read row by row; table [2^L, V] float32), by the C walk of
    trellis_decode.c; None off the CPU or where it cannot be built (the caller decodes with torch ops). The
    torch decode's values bit for bit (the same table), and what makes a trellis layer's CPU forward, which decodes
    its whole weight, several times faster (scripts/bench_cpu_codebook.py)."""
    decode = native_decode() if codes.device.type == "cpu" else None
    if decode is None:
        return None
    codes = codes.to(torch.int32)  # any strides: the C reads them
    table = table.to(torch.float32).contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32)
    tiles = codes.shape[0] // tile_rows
    workers = max(1, min(torch.get_num_threads(), tiles))
    bounds = [tiles * i // workers for i in range(workers + 1)]

    def run(i):
        decode(codes.shape[1], *codes.stride(), L, k, V, tile_rows, width, bounds[i], bounds[i + 1],
               codes.data_ptr(), table.data_ptr(), out.data_ptr())

    native.side_by_side(run, workers, workers)
    return out

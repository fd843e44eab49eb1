"""QTIP's trellis-coded quantizer (Tseng et al., 2024, arXiv 2406.11235) as a quantizer: --quantizer trellis, and the
methods trellis (rotated, data-free) and trellis+gptq (inside GPTQ's error feedback).

A layer's weights are cut into sequences of `length` weights: tiles of `tile_rows` rows x length / tile_rows consecutive
columns, read row by row (by default tiles of 64 rows x 4 columns: see below). The tile's columns are the quantizer's
width: GPTQ rounds one column block of tiles at a time, its error fed to the columns after it. Each
sequence is one tail-biting walk through the bitshift trellis of quantkit.schemes.trellis_codes: `state_bits` L bits
of state, `step` V weights per step, `bits` k bits per weight, state values from `code` (1mad, 3inst or hyb):

    w_hat = scale * value(state)_v          one fp16 scale per row and group (the group a multiple of the width)

so a sequence of T weights costs exactly k·T bits plus its share of the scales: k + 16 / group_size bits per weight.
The codes (k bits per column, quantkit.schemes.trellis_codes) are found by the exact Viterbi search of
quantkit.schemes.trellis_viterbi with QTIP's two-search tail-biting, weighted per column inside GPTQ (the unit's
error costs differ by column). dequantize decodes states from codes with the tables the search used: a reader's
weights are the search's bit for bit.

Defaults, measured on unit Gaussians in blocks of 256 with an fp16 scale each, one core of the project's CPU
(scripts/bench_distortion.py, the C search): QTIP's L = 16 over sequences of 256 weights, in tiles of 64 rows x 4
columns (GPTQ feeds back per 4 columns; 64 divides every common layer width); per bit width the step and code with
the least MSE: V = 2 with 3INST at 1 and 2 bits (V = 1 gains 0.4 % at 2 bits for 3.8x the time), V = 1 with 1MAD at 3
and 4 bits (V = 2 shares only L - 2k state bits between steps: 3 % / 7 % more MSE). MSE 0.0691 / 0.0176 / 0.0045 at
2 / 3 / 4 bits (1.11 / 1.13 / 1.16x the bound 4^-k; E8P: 0.0888 / 0.0277 / 0.0073) in 9.5 / 24 / 15 s per million
weights. `--quantizer trellis-l12` (L = 12 on tiles of 32 x 2, the default until 2026-11-28) searches 13-23x faster
for 1.21 / 1.24 / 1.29x the bound; `--quantizer trellis-l16` is QTIP's own tile shape (16 x 16), which GPTQ's
feedback likes less than 64 x 4 (one unit of 16 columns). The 4-bit MSE reaches 1.13x the bound only at L = 19 (L
17: 1.146x, 18: 1.134x, each state bit doubling the search).

The scale of a group (`scale`): "rms" is the group's rms over the value table's, times GAIN[bits] (measured the same
way: a trellis at more bits wants a wider table); "refit" also searches the group at that scale and keeps the
least-squares scale of the codes found (s = <w, p> / <p, p>): about 1 % less MSE for a second search per group.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from quantkit.core.errors import QuantkitError
from quantkit.core.options import is_int
from quantkit.schemes.base import KernelDecode, offer_method, register_quantizer, register_spec_name
from quantkit.schemes.grid import check_bits
from quantkit.schemes.scales import OneScalePerGroup, fp16_scale
from quantkit.schemes.trellis_codes import CODES, codes_of_symbols, states_of_codes, sunflower_table, values_of_codes
from quantkit.schemes.trellis_codes import values as state_values
from quantkit.schemes.trellis_viterbi import tail_biting

SUPPORTED_BITS = (1, 2, 3, 4)
SCALES = ("rms", "refit")
GAIN = {1: 0.85, 2: 1.0, 3: 1.1, 4: 1.15}  # the rms scale's multiplier per bit width, measured (module docstring)
DEFAULT_STEP_CODE = {1: (2, "3inst"), 2: (2, "3inst"), 3: (1, "1mad"), 4: (1, "1mad")}  # per bit width, measured
DEFAULT_STATE_BITS, DEFAULT_LENGTH = 16, 256
# Narrow tiles, not a row's columns: GPTQ feeds the error back once per unit of `width` columns, and wide units lose
# more than the trellis gains. SmolLM2 layers.15.self_attn.o_proj, 3 bits, g128, rotated, GPTQ with act-order
# (relative output error; data-free in brackets), L = 12, sequences of 64: 64 columns of a row 0.00411 (0.01730),
# 4 x 16 tiles 0.00256, 8 x 8 0.00232 (0.01689), 16 x 4 0.00225, 32 x 2 0.00223, 64 x 1 0.00221; turboquant 0.00387
# (0.02751), e8p 0.00361 (0.02466). At L = 16, sequences of 256: 16 x 16 tiles 0.00230 (0.01539), 64 x 4 0.00202
# (0.01499); at 2 bits 0.00947 and 0.00829 (L = 12, 32 x 2: 0.00910). 64 x 4 is the narrowest tile of 256 weights
# whose height divides common widths (k/v projections of 192 and 1024 rows; 128 x 2 would not).
DEFAULT_TILE_ROWS = 64
FAST_SETTING = dict(state_bits=12, length=64, tile_rows=32)  # --quantizer trellis-l12: the default until 2026-11-28
HYB_INDEX_BITS = 9


def _check_int(value, what, lo, hi):
    if not is_int(value) or not lo <= value <= hi:
        raise QuantkitError(f"trellis {what} must be a whole number in {lo}..{hi}, got {value!r}")


@register_quantizer
@dataclass(frozen=True)
class Trellis(OneScalePerGroup):
    """Trellis-coded quantization (module docstring): k = `bits` bits per weight over sequences of `length` weights
    (tiles of `tile_rows` rows), L = `state_bits`, V = `step`, state values from `code` (step and code: the bit width's
    defaults when None); `table` the hyb lookup table (2^9 (x, y) pairs)."""
    bits: int
    state_bits: int = DEFAULT_STATE_BITS
    step: Optional[int] = None
    code: Optional[str] = None
    length: int = DEFAULT_LENGTH
    scale: str = "rms"
    table: Optional[tuple] = None
    tile_rows: int = DEFAULT_TILE_ROWS

    name = "trellis"
    summary = ("QTIP's bitshift trellis (16 state bits; exact Viterbi over tail-biting tiles of 64 rows x 4 columns; "
               "output widths a multiple of 64), one fp16 scale per group; bits 1-4")
    weighted_round = True

    def __post_init__(self):
        check_bits(self.bits, "trellis bits", SUPPORTED_BITS)
        step, code = DEFAULT_STEP_CODE[self.bits]
        object.__setattr__(self, "step", step if self.step is None else self.step)
        object.__setattr__(self, "code", code if self.code is None else self.code)
        _check_int(self.step, "step (weights per trellis step)", 1, 2)
        kv = self.bits * self.step
        _check_int(self.state_bits, f"state_bits at {self.bits} bits x {self.step} weights per step", kv + 1, 20)
        _check_int(self.length, "length (weights per sequence)", 1, 1 << 16)
        _check_int(self.tile_rows, "tile_rows", 1, self.length)
        if self.length % (self.tile_rows * self.step) or (self.length // self.step) * kv < self.state_bits:
            raise QuantkitError(f"a trellis sequence of {self.length} weights must be whole rows of a tile of "
                                f"{self.tile_rows} rows, a multiple of step {self.step} per row, and carry at least "
                                f"state_bits = {self.state_bits} bits")
        if self.code not in CODES:
            raise QuantkitError(f"trellis code {self.code!r} is unknown: use {', '.join(CODES)}")
        if self.scale not in SCALES:
            raise QuantkitError(f"trellis scale {self.scale!r} is unknown: use {', '.join(SCALES)}")
        object.__setattr__(self, "table", self._checked_table())

    def _checked_table(self):
        """hyb's table (the default sunflower if none is given) as a tuple of float32 pairs; None for the others."""
        if self.code != "hyb":
            if self.table is not None:
                raise QuantkitError(f"trellis code {self.code} computes its values: it takes no table")
            return None
        if self.step != 2 or self.state_bits <= HYB_INDEX_BITS:
            raise QuantkitError(f"the hyb code decodes 2 weights per step from more than {HYB_INDEX_BITS} state bits: "
                                f"use step 2 and state_bits >= {HYB_INDEX_BITS + 1}")
        table = sunflower_table(HYB_INDEX_BITS) if self.table is None else self.table
        try:
            t = torch.tensor(table, dtype=torch.float32) if isinstance(table, (list, tuple)) else None
        except (TypeError, ValueError):  # ragged or not numbers
            t = None
        if t is None or t.shape != (1 << HYB_INDEX_BITS, 2) or not bool(torch.isfinite(t).all()):
            raise QuantkitError(f"a hyb table needs {1 << HYB_INDEX_BITS} finite (x, y) pairs")
        return tuple(tuple(p) for p in t.tolist())

    @classmethod
    def from_spec(cls, bits: int, sym: bool, group_size: int, **settings) -> "Trellis":
        quantizer = cls(bits, **settings)
        if group_size != -1 and (not is_int(group_size) or group_size % quantizer.width):
            raise QuantkitError(f"{quantizer.name} rounds tiles {quantizer.width} columns wide: --group-size must "
                                f"be a multiple of {quantizer.width} (or -1), got {group_size}")
        return quantizer

    @property
    def width(self) -> int:
        """Columns rounded at once: a sequence's columns (its tile's width)."""
        return self.length // self.tile_rows

    @property
    def row_multiple(self) -> int:
        """The layer's output rows must be a multiple of this (a tile's height): quantkit.core.groups.check_shape
        refuses other row counts before any work, and the runtime decodes strips of whole tiles."""
        return self.tile_rows

    @property
    def kernel_decode(self) -> KernelDecode:
        """The Triton decode's settings (kernels/triton_trellis.py: the weight decoded, then one GEMM)."""
        table = tuple(x for pair in self.table for x in pair) if self.table is not None else ()
        return KernelDecode("trellis", table=table,
                            trellis=(self.state_bits, self.step, self.code, self.tile_rows, self.length))

    def settings(self) -> dict:
        out = {"bits": self.bits, "state_bits": self.state_bits, "step": self.step, "code": self.code,
               "length": self.length, "tile_rows": self.tile_rows, "scale": self.scale}
        if self.table is not None:
            out["table"] = [list(p) for p in self.table]
        return out

    def values(self, device) -> torch.Tensor:
        """[2^L, V] float32: every state's value, on `device`; one table per setting, shared by every layer that
        has it (GPTQ asks once per sequence; a CPU forward's decode looks it up per weight, and a table per layer
        would push each layer's out of the cache before it is used again)."""
        return _state_table(self.code, self.state_bits, self.step, self.table, torch.device(device))

    @property
    def spread(self) -> float:
        """The rms of the value table: the scale that maps it onto unit-rms weights."""
        return float(self.values("cpu").pow(2).mean().sqrt())

    def check_tiles(self, shape) -> None:
        """QuantkitError unless a [rows, cols] weight is whole tiles of tile_rows rows x width columns."""
        rows, cols = shape
        if rows % self.tile_rows or cols % self.width:
            raise QuantkitError(f"the trellis quantizer reads tiles of {self.tile_rows} rows x {self.width} columns: "
                                f"a [{rows}, {cols}] weight does not split into them")

    def sequences(self, t: torch.Tensor) -> torch.Tensor:
        """[sequences, length] of t [rows, cols]: tiles of tile_rows rows x width columns, each read row by row."""
        self.check_tiles(t.shape)
        rows, cols = t.shape
        h, c = self.tile_rows, self.width
        return t.reshape(rows // h, h, cols // c, c).transpose(1, 2).reshape(-1, self.length)

    def unsequence(self, seqs: torch.Tensor, shape) -> torch.Tensor:
        """The inverse of sequences: [sequences, length] back to [rows, cols]."""
        rows, cols = shape
        h, c = self.tile_rows, self.width
        return seqs.reshape(rows // h, cols // c, h, c).transpose(1, 2).reshape(rows, cols)

    def _search(self, y: torch.Tensor, importance=None):
        """(states [sequences, n], values [rows, cols]) of the scaled weights y [rows, cols]."""
        V = self.step
        seqs = self.sequences(y).reshape(-1, self.length // V, V)
        weights = None
        if importance is not None:
            weights = self.sequences(importance.to(y)[None].expand(y.shape)).reshape(seqs.shape)
        table = self.values(y.device)
        states, _ = tail_biting(seqs, table, self.state_bits, self.bits * V, weights)
        return states, self.unsequence(table[states].reshape(-1, self.length), y.shape)

    def fit(self, w: torch.Tensor, importance=None) -> dict:
        """{"scale": [rows]} of one group w [rows, cols] (`importance` unused: the scale is unweighted)."""
        w = w.float()
        s = fp16_scale(w.pow(2).mean(dim=1).sqrt() * (GAIN[self.bits] / self.spread))
        if self.scale == "refit":
            p = self._search(w / s[:, None])[1]
            refit = fp16_scale((w * p).sum(dim=1) / (p * p).sum(dim=1).clamp(min=1e-30))
            keep = (w - refit[:, None] * p).pow(2).sum(dim=1) < (w - s[:, None] * p).pow(2).sum(dim=1)
            s = torch.where(keep, refit, s)
        return {"scale": s}

    def round(self, w: torch.Tensor, params: dict, importance=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, dequantized) of w [rows, k * length] with per-row scales [rows]; importance [cols], if given,
        weighs each column's squared error in the search."""
        s = params["scale"][:, None].to(w.dtype)
        states, points = self._search(w.float() / s, importance)
        kv = self.bits * self.step
        codes = self.unsequence(codes_of_symbols(states & ((1 << kv) - 1), self.bits, self.step), w.shape)
        return codes, s * points.to(w.dtype)

    def dequantize(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        """Weights [rows, cols] of codes [rows, cols] with per-column params (scale [rows, cols])."""
        self.check_tiles(codes.shape)
        points = values_of_codes(codes, self.values(codes.device), self.state_bits, self.bits, self.step,
                                 self.tile_rows, self.width)
        if points is None:  # off the CPU, or no C compiler
            states = states_of_codes(self.sequences(codes), self.state_bits, self.bits, self.step)
            points = self.unsequence(self.values(codes.device)[states].reshape(-1, self.length), codes.shape)
        return params["scale"].float() * points


@lru_cache(maxsize=16)
def _state_table(code: str, L: int, V: int, table, device: torch.device) -> torch.Tensor:
    return state_values(code, L, V, table).to(device)


def qtip_setting(bits: int, sym: bool, group_size: int) -> Trellis:
    """QTIP's own setting: L = 16 over tiles of 16 x 16 (sequences of 256 weights)."""
    return Trellis.from_spec(bits, sym, group_size, state_bits=16, length=256, tile_rows=16)


def fast_setting(bits: int, sym: bool, group_size: int) -> Trellis:
    """The fast setting, the default until 2026-11-28: L = 12 over tiles of 32 x 2 (sequences of 64 weights)."""
    return Trellis.from_spec(bits, sym, group_size, **FAST_SETTING)


register_spec_name("trellis-l12", fast_setting,
                   "the trellis with 12 state bits over tiles of 32 x 2 weights: a 13-23x faster search for 8-10 % "
                   "more error (1.21-1.29x the distortion bound against 1.10-1.16x); output widths a multiple of 32; "
                   "recorded as trellis; --method trellis and trellis+gptq take it", method="trellis")
register_spec_name("trellis-l16", qtip_setting,
                   "the trellis at QTIP's own tile shape, 16 state bits over tiles of 16 x 16 weights (GPTQ's "
                   "feedback, one unit of 16 columns, left 14 % more error on a SmolLM2 layer than the default's "
                   "64 x 4); output widths a multiple of 16; recorded as trellis; --method trellis and trellis+gptq "
                   "take it", method="trellis")
offer_method("trellis", "QTIP's trellis-coded quantization (bitshift trellis, exact Viterbi, tail-biting)")

"""Triton fused dequant-GEMM for the GPTQ layout: y = x @ W^T (+ bias), W decoded in registers.

Layout and decoding helpers: triton_decode.py (bits 2, 3, 4, 8). The M = 1 inner loops: triton_gemv.py.

One kernel, three launch shapes (Marlin / Triton-tutorial style: kernel + thin wrapper in
triton_gptq_ops.py + pure-torch reference in reference.py):
  * M = 1 (memory-bound GEMV): BLOCK_M = 1, fp32 FMAs in the packed words' own register layout
    (see gemv_tile: about three instructions per weight, W used exactly, never rounded).
    Bits 2, 4, 8 only: 3-bit words do not hold whole codes, so M = 1 takes the next shape. The
    autotuner may also run M = 1 on that shape's by-code tiles (M1_CONFIGS).
  * 2 <= M <= 16 (memory-bound decode): BLOCK_M = 16 tl.dot (mma.sync) on the decoded tile.
  * M > 16 (compute-bound GEMM): tiled tl.dot (wgmma on Hopper), grouped tile order for L2 reuse.
The mma.sync tiles (BLOCK_M 16 and 32) of 4- and 8-bit weights with one group per tile take one tl.dot
per code position of the packed words instead, when that leaves tl.dot its 16 rows (BLOCK_K >= 128 at
4 bits, >= 64 at 8): rows 8j + c for code c of 4-bit word j, x split to match in registers. The decoded
codes then feed the MMA in the words' own layout, without the [BLOCK_K / 8, 8, N] -> [BLOCK_K, N]
reshape that costs one shared-memory store per weight (sm_90 SASS: docs/BENCHMARKS.md; the wgmma
tiles gain nothing from it).
Split-K whenever the output tiles alone do not fill the GPU (always at small M): the K slices of a
tile are reduced *inside* the launch: each program stores its fp32 partial, bumps a per-tile
counter, and the last one to arrive sums the partials in a fixed order, adds bias, writes the
output and resets the counter. One launch, no memset, deterministic (the sum order does not depend
on which program finishes last).
Group handling: when g_idx is the plain `k // group_size` (also what act-order with static groups
stores) and BLOCK_K divides the group size, a K tile lies in one group, so one row of scales/zeros
is loaded per tile ("uniform"). Otherwise (act-order g_idx, odd group sizes) g_idx is read for
every k and scales/zeros are gathered per element ("gather"): correct for any g_idx, slower.
Integer codes become floats by the exponent trick (no I2F conversions, which are quarter rate and
bounded the first version). The tl.dot paths round W exactly like the torch reference (fp16: the
product of an fp16 scale and a small integer is exact before its one rounding; bf16: computed in
fp32, rounded once); the M = 1 path keeps W exact in fp32.
Measured on H100 and what limits each path: docs/BENCHMARKS.md.
"""
import triton
import triton.language as tl

from quantkit.kernels.triton_decode import (dequant, group_params, group_row, in_range, load_words, store_tile,
                                            tile_codes, x_by_code)
from quantkit.kernels.triton_gemv import gemv_tile, gemv_tile_half2


@triton.jit
def gptq_matmul_kernel(
        x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
        M, N, K, KW, NW, GS, stride_xm, stride_ym, SPLIT_K,  # SPLIT_K: runtime, no recompile per value
        M_BUCKET, NUM_SMS, WAVES,  # read only by the autotune key / split heuristic (no recompiles)
        BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr,
        IS_FP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
        INTERPRETER: tl.constexpr = False, HALF2: tl.constexpr = False):
    """y [M, N] = x [M, K] @ W^T (+ bias), one [BLOCK_M, BLOCK_N] output tile and K slice a program (the module
    docstring has the shapes); launched through m1_kernel, decode_kernel, gemm_kernel or untuned_kernel."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M consecutive programs share a weight column strip (L2 reuse at large M).
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = in_range(offs_n, N, EVEN_N)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm

    # This program's K slice: a whole number of BLOCK_K tiles, so tiles never straddle slices.
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + tiles_per_split * BLOCK_K)

    if BLOCK_M == 1:
        tl.static_assert(BITS != 3, "3-bit words do not hold whole codes: M = 1 uses the BLOCK_M = 16 shape")
        acc2 = tl.zeros((BLOCK_K // (32 // BITS), BLOCK_N), dtype=tl.float32)   # summed over rows at the end
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Per code position (BLOCK_K // (32 // BITS) rows per tl.dot, which needs 16; mma.sync tiles): module docstring.
    BY_CODE: tl.constexpr = (BLOCK_M >= 16 and BLOCK_M <= 32 and (BITS == 4 or BITS == 8) and UNIFORM
                             and BLOCK_K // (32 // BITS) >= 16)
    # Masking x (not W) handles K past in_features: the zero-padded codes meet x = 0.
    for k0 in range(k_begin, k_end, BLOCK_K):
        if BLOCK_M == 1 or BY_CODE:  # one int32 load per word; its codes are shifted out in registers
            words = load_words(qw_ptr, k0, offs_n, n_mask, N, KW, BITS, BLOCK_K, EVEN_K)
        if UNIFORM:  # the whole tile lies in one group
            s, z = group_row(s_ptr, qz_ptr, k0 // GS, offs_n, n_mask, N, NW, BITS, ZERO_OFFSET)
        else:        # per-k groups: loaded inside the tile functions
            s, z = 0.0, 0
        if BLOCK_M == 1 and HALF2 and BITS == 4 and UNIFORM and IS_FP16:   # packed fp16 math (triton_gemv)
            acc2 = gemv_tile_half2(acc2, words, x_ptr + pid_m.to(tl.int64) * stride_xm, k0, K, s, z, BLOCK_K,
                                    EVEN_K, INTERPRETER)
        elif BLOCK_M == 1:
            acc2 = gemv_tile(acc2, words, x_ptr + pid_m.to(tl.int64) * stride_xm, k0, K, s, z, g_ptr, s_ptr,
                              qz_ptr, offs_n, n_mask, N, NW, BITS, ZERO_OFFSET, UNIFORM, BLOCK_K, EVEN_K)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = in_range(offs_k, K, EVEN_K)
            if BY_CODE:
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                xs = x_by_code(x, BITS, BLOCK_M, BLOCK_K)
                for c in tl.static_range(32 // BITS):
                    w = dequant((words >> (BITS * c)) & ((1 << BITS) - 1), z, s, IS_FP16, INTERPRETER)
                    acc = _dot(xs[c], w, acc, INTERPRETER)
            else:
                q = tile_codes(qw_ptr, k0, offs_k, offs_n, n_mask, N, KW, BITS, BLOCK_K, BLOCK_N, EVEN_K)
                if not UNIFORM:
                    g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)[:, None]
                    s, z = group_params(s_ptr, qz_ptr, g, offs_n, n_mask, N, NW, BITS, ZERO_OFFSET)
                w = dequant(q, z, s, IS_FP16, INTERPRETER)
                # x after the decode, as before the by-code tiles: loaded first, it spills a 128 x 128 x 128
                # 8-bit tile on sm_80 (scripts/sass_stats.py --check)
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                acc = _dot(x, w, acc, INTERPRETER)
    if BLOCK_M == 1:
        acc = tl.reshape(tl.sum(acc2, axis=0), (1, BLOCK_N))

    store_tile(y_ptr, b_ptr, ws_ptr, lock_ptr, acc, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym,
               pid_m * grid_n + pid_n, pid_k, SPLIT_K, HAS_BIAS, INTERPRETER)


@triton.jit
def _dot(x, w, acc, INTERPRETER: tl.constexpr):
    if INTERPRETER:  # its tl.dot mishandles bf16 (numpy has none); the fp32 upcast is exact
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, w, acc)


def split_k(m, n, k, block_m, block_n, block_k, num_sms, waves):
    """K slices per tile so that tiles * slices ~ waves * SMs (1 when the tiles alone fill the GPU)."""
    tiles = -(-m // block_m) * -(-n // block_n)
    k_tiles = -(-k // block_k)
    want = -(-(num_sms * waves) // tiles)
    return max(1, min(want, k_tiles, 64))


def _split_heuristic(a):
    return split_k(a["M"], a["N"], a["K"], a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_K"], a["NUM_SMS"],
                   a["WAVES"])


def _config(bm, bn, bk, waves, warps, stages, group_m=8, half2=False):
    kw = dict(BLOCK_N=bn, BLOCK_K=bk, WAVES=waves, GROUP_M=group_m)
    if bm is not None:
        kw["BLOCK_M"] = bm
    if half2:
        kw["HALF2"] = True
    return triton.Config(kw, num_warps=warps, num_stages=stages)


# M = 1 (BLOCK_M = 1, FMA path): 4-32 words per thread per tile, loaded 16 bytes at a time; BLOCK_N
# of 128+ with BLOCK_K 64 picks a poor layout (checked in SASS), so it is left out. No tl.dot, so
# nothing for the software pipeliner: memory-level parallelism comes from resident programs, which
# WAVES (programs ~ WAVES x SMs through split-K) sets. Uniform groups need BLOCK_K | group size, so
# g128 runs the BLOCK_K <= 128 tiles; the 256 x 128 and 128 x 128 tiles with 4 warps (5.4 and 5.6
# instructions per weight in sm_90 SASS against 6.2 for 64 x 128) are not yet timed on a GPU.
# Every M = 1 config names its BLOCK_M: 1 for these FMA tiles, 16 for the by-code tl.dot tiles below.
M1_CONFIGS = [
    _config(1, bn, bk, waves, warps, 2)
    for bn, bk, warps in [(64, 128, 4), (32, 128, 4), (128, 128, 8), (64, 256, 8), (32, 256, 4), (64, 512, 8),
                          (64, 32, 4), (256, 128, 4), (128, 128, 4)]
    for waves in (4, 8, 16)
]
# M = 1 on the 2 <= M <= 16 by-code tl.dot tiles (4- and 8-bit, one group per tile; _prune drops them
# elsewhere): the MMA's 15 idle rows are free in a memory-bound loop, and their sm_90 SASS needs 4.3-4.7
# instructions per weight against 5.4-6.2 for the FMA tiles. Plain Triton (no inline PTX), the code
# that M = 2-16 already runs, so the autotuner may pick them; not yet timed on a GPU.
M1_CONFIGS += [_config(16, bn, 128, waves, 4, 3) for bn in (128, 256) for waves in (4, 8, 16)]
# M = 1 in packed fp16 math (triton_gemv._gemv_tile_half2; INT4, uniform groups, fp16 x; other inputs
# run the FMA path): 4.0-4.8 instructions per weight in sm_90 SASS. Checked under the interpreter and
# compiled for sm_90 (scripts/sass_stats.py --kind m1h2), but its inline PTX has not run on a GPU yet,
# so it is not in the autotune list until it has: tests/test_kernels.py pins it on CUDA and
# scripts/bench_kernels.py --m1-half2 offers it to the autotuner.
M1_HALF2_CONFIGS = [
    _config(1, bn, bk, waves, warps, 2, half2=True)
    for bn, bk, warps in [(64, 128, 4), (256, 128, 4), (256, 128, 8), (512, 128, 8), (256, 64, 4)]
    for waves in (4, 8, 16)
]
# 2 <= M <= 16 (BLOCK_M = 16, tl.dot on mma.sync): pipelined cp.async word loads.
DECODE_CONFIGS = [
    _config(None, bn, bk, waves, warps, stages)
    for bn, bk, warps, stages in [(64, 128, 4, 3), (32, 128, 4, 4), (128, 128, 4, 3), (64, 64, 4, 4),
                                  (128, 64, 4, 4), (64, 256, 4, 3), (64, 32, 4, 4), (256, 128, 4, 3), (256, 128, 8, 3),
                                  (128, 256, 4, 3)]
    for waves in (2, 4)
]
# GEMM: the usual Hopper tile shapes (tl.dot -> wgmma); WAVES=1 so split-K only rescues few tiles.
# (128, 256, 64) with 8 warps spills registers (SASS), so it is not offered; nor do 32 x 256 x 128 with 4 warps
# and 32 x 128 x 256 (the 32-row tiles multiply by code position: module docstring).
GEMM_CONFIGS = [
    _config(bm, bn, bk, 1, warps, stages)
    for bm, bn, bk, warps, stages in [
        (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3),
        (64, 256, 64, 8, 4), (128, 64, 64, 4, 4), (64, 64, 128, 4, 4), (32, 128, 128, 4, 4),
        (128, 128, 32, 4, 4), (64, 128, 32, 4, 4), (32, 256, 128, 8, 4)]
]


def fits_bits(config, bits):
    """3-bit tiles gather two words per weight; past 64 weights per thread they spill registers
    (sm_90 SASS, scripts/sass_stats.py), so 3-bit is offered the smaller tiles only."""
    return bits != 3 or config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"] <= 64 * 32 * config.num_warps


def fits_groups(config, args):
    """Uniform-group mode needs every K tile inside one group: BLOCK_K must divide the group size."""
    return not args["UNIFORM"] or args["GS"] % config.kwargs["BLOCK_K"] == 0


def _prune(configs, named_args, **kwargs):
    """Configs that fit the call: whole groups per tile (fits_groups); 3-bit takes the tiles that do
    not spill; HALF2 tiles are timed only where they change the code (4-bit, uniform groups, fp16), and
    M = 1's 16-row tiles only where they multiply by code position (4- and 8-bit, uniform groups)."""
    a = {**named_args, **kwargs}
    half2_applies = a["BITS"] == 4 and a["UNIFORM"] and a["IS_FP16"]
    by_code_applies = a["BITS"] in (4, 8) and a["UNIFORM"]
    keep = [c for c in configs if fits_groups(c, a) and fits_bits(c, a["BITS"])
            and (half2_applies or not c.kwargs.get("HALF2"))
            and (by_code_applies or not (a["M_BUCKET"] == 1 and c.kwargs.get("BLOCK_M") == 16))]
    return keep or configs[:1]


_KEY = ["M_BUCKET", "N", "K", "GS", "BITS", "UNIFORM", "IS_FP16"]
_heuristic_kernel = triton.heuristics({
    "SPLIT_K": _split_heuristic,
    "EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,   # no K masks: every tile is full
    "EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0,   # no column masks
})(gptq_matmul_kernel)
m1_kernel = triton.autotune(M1_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune})(
    _heuristic_kernel)
decode_kernel = triton.autotune(DECODE_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune})(
    _heuristic_kernel)
gemm_kernel = triton.autotune(GEMM_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune})(
    _heuristic_kernel)
untuned_kernel = _heuristic_kernel  # fixed config: interpreter runs, tests that pin a path/config


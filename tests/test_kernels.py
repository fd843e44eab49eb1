"""GPTQ dequant-GEMM kernels against the pure-torch reference.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on CPU tensors (set below, before
anything imports the kernel module); shapes stay small because the interpreter is slow. With a GPU
the same cases run on CUDA with the compiled kernels. The interpreter decides at decoration time,
so one process runs one flavour: "cpu" cases need the interpreter, "cuda" cases need it off.

Error bound (why `assert_close_to_reference` is fair, not loose), with u the unit roundoff of the
activation dtype (2^-11 fp16, 2^-8 bf16) and mag = |x| @ |W^T| + |bias| (computed in fp64):
  * Weights: the dot-product paths decode W with the reference's single rounding (bit-identical
    weights); the M = 1 FMA path uses W exactly (never rounded to fp16/bf16), which moves each
    product by at most u * |x_k w_k|: at most u * mag in total.
  * Accumulation: fp32 in the kernels (fp64 here); order differences, split-K partials and the
    bias add are bounded by gamma * mag with gamma = 2K * 2^-24 (worst-case summation bound).
  * Output: rounded once to fp16 / bf16, at most u * |y|, plus half the smallest fp16 subnormal
    (2^-25) for tiny outputs.
So |y - ref| <= u * |ref| + (u + 2K * 2^-24) * mag + 2^-25. A wrong code, zero, scale, group or
mask moves an element by about |x_k * w_k|: with K <= 200 that is ~1/K of mag per term, still far
above u * mag (u = 2^-8 at worst), so the bound catches every such bug (checked by mutation).
The packed-fp16 M = 1 path (HALF2 configs; 4-bit, uniform groups, fp16) multiplies and sums in fp16:
x is scaled by 2^-6 (exact unless subnormal), each product and each of the 3 sums of a word's
four-term partial rounds once: at most gamma_4 ~ 4 * 2^-11 of sum|p| relative, i.e. 4 * 2^-11 * mag
after the fp32 rescale by 64 * s, plus 2^-25 absolute per fp16 operation where values are subnormal,
i.e. 3 * 2^-19 * |s| per term: its bound adds 4 * 2^-11 * mag + 3K * 2^-19 * max|s|. A wrong code still
moves an element by ~mag/K >= 10 * 2^-11 * mag (K <= 200), above the ~6 * 2^-11 * mag allowed here.
"""
import os
import sys

import pytest
import torch

# The interpreter must be on before triton is first imported (its standard library is decorated at
# import). In a full test run another module may already have imported it (via transformers): then
# the CPU cases run in a fresh process instead (test_interpreter_cases_in_fresh_process).
PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available() and not PREIMPORTED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

from quantkit.core import bitpack  # noqa: E402
from quantkit.checkpoint import gptq
from quantkit.kernels import gptq_linear  # noqa: E402
from quantkit.kernels.reference import dequantize_weight, gptq_linear_torch  # noqa: E402
from quantkit.nn.quant_linear import QuantLinear  # noqa: E402
from tiny_models import dequantize_gptq
from triton_cases import device_params, rerun_with_interpreter  # noqa: E402

try:
    import triton  # noqa: F401

    from quantkit.kernels import dispatch, triton_gptq_ops
    from quantkit.kernels.triton_dequant import dequantize_triton
    from quantkit.kernels.triton_gptq_ops import gptq_matmul
except Exception as e:  # pragma: no cover - platform without triton
    triton_gptq_ops, TRITON_ERROR = None, e
else:
    TRITON_ERROR = None

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


DEVICES = device_params(TRITON_ERROR, INTERPRET, PREIMPORTED)
# Pinned configs for the GPU cases: autotuning every layout would compile ~14 variants per case.
GPU_CONFIGS = {True: dict(BLOCK_N=64, BLOCK_K=32, WAVES=2, GROUP_M=8),
               False: dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, WAVES=1, GROUP_M=8)}


def make_layer(k, n, bits, group_size, sym=False, zero_offset=1, act_order=False, bias=False,
               device="cpu", seed=0):
    """GPTQ-layout tensors packed with bitpack.pack from random codes (v1 needs zeros >= 1)."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else -(-k // group_size)
    codes = torch.randint(0, 2**bits, (k, n), generator=gen)
    if sym:
        zeros = torch.full((groups, n), 2 ** (bits - 1))
    else:
        zeros = torch.randint(zero_offset, 2**bits, (groups, n), generator=gen)
    g_idx = torch.arange(k) // (k if group_size == -1 else group_size)
    if act_order:  # arbitrary (non-monotonic) group of each input column
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    t = dict(qweight=bitpack.pack(codes, bits, dim=0),
             qzeros=bitpack.pack(zeros - zero_offset, bits, dim=1),
             scales=(torch.rand(groups, n, generator=gen) * 0.02 + 0.002).half(),
             g_idx=g_idx.to(torch.int32).contiguous(),
             bias=torch.randn(n, generator=gen).half() if bias else None)
    return {name: v.to(device) if v is not None else None for name, v in t.items()}


def reference(x, layer, bits, k, zero_offset):
    """fp64 x @ W^T (+ bias) with W decoded exactly as the kernels must decode it."""
    w = dequantize_weight(layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k,
                          zero_offset, dtype=x.dtype).double()
    y = x.double() @ w
    mag = x.double().abs() @ w.abs()
    if layer["bias"] is not None:
        y, mag = y + layer["bias"].double(), mag + layer["bias"].double().abs()
    return y, mag


def assert_close_to_reference(y, x, layer, bits, k, zero_offset, half2=False):
    ref, mag = reference(x, layer, bits, k, zero_offset)
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert torch.isfinite(y).all()
    u = UNIT_ROUNDOFF[x.dtype]
    tol = u * ref.abs() + (u + 2 * k * 2.0**-24) * mag + 2.0**-25
    if half2:  # the packed-fp16 M = 1 path (module docstring)
        tol = tol + 4 * 2.0**-11 * mag + 3 * k * 2.0**-19 * layer["scales"].abs().max().item()
    err = (y.double() - ref).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"max |y - ref| / bound = {worst:.3f} (max abs err {err.max().item():.3e})"


def run(x, layer, bits, k, zero_offset, config=None):
    if config is None and x.is_cuda:
        config = GPU_CONFIGS[x.shape[0] <= triton_gptq_ops.DECODE_MAX_M]
    return gptq_matmul(x, layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k,
                       layer["bias"], zero_offset, config=config)


# Layouts: every (M, bits, group size) crossed; the binary options rotate through all 32
# combinations so each appears with every M / bits / group size at least once overall.
# K = 100 / 200 is neither a multiple of the group size nor (2- and 3-bit) of the pack unit;
# N = 40 / 70 is not a multiple of any BLOCK_N.
_BINARY = [(s, zo, a, b, dt) for s in (False, True) for zo in (0, 1) for a in (False, True)
           for b in (False, True) for dt in (torch.float16, torch.bfloat16)]
LAYOUTS = []
for i, (m, bits, gs) in enumerate([(m, b, g) for m in (1, 3, 17) for b in (2, 3, 4, 8) for g in (32, -1, 48)]):
    sym, zo, act, bias, dt = _BINARY[(i * 7) % len(_BINARY)]
    k, n = (200, 70) if gs == 48 else (100, 40)
    LAYOUTS.append(pytest.param(m, k, n, bits, gs, sym, zo, act, bias, dt,
                                id=f"M{m}-K{k}-N{n}-b{bits}-g{gs}-{'sym' if sym else 'asym'}-zo{zo}"
                                   f"{'-act' if act else ''}{'-bias' if bias else ''}-{str(dt)[6:]}"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,k,n,bits,gs,sym,zo,act,bias,dtype", LAYOUTS)
def test_kernel_matches_reference(device, m, k, n, bits, gs, sym, zo, act, bias, dtype):
    layer = make_layer(k, n, bits, gs, sym, zo, act, bias, device=device, seed=m * 100 + bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    assert_close_to_reference(run(x, layer, bits, k, zo), x, layer, bits, k, zo)


# Launch shapes pinned one by one: M = 1 FMA path, M <= 16 tl.dot path, GEMM; split-K on and off;
# BLOCK_K = 64 with group size 32 (uniform mode impossible: must fall back to the gather path).
PATHS = {
    "decode-m1-split": (1, dict(BLOCK_N=32, BLOCK_K=32, WAVES=4, GROUP_M=1)),
    "decode-m1-nosplit": (1, dict(BLOCK_N=64, BLOCK_K=64, WAVES=0, GROUP_M=1)),
    "decode-m1-half2-split": (1, dict(BLOCK_N=32, BLOCK_K=32, WAVES=4, GROUP_M=1, HALF2=True)),
    "decode-m1-half2-nosplit": (1, dict(BLOCK_N=64, BLOCK_K=32, WAVES=0, GROUP_M=1, HALF2=True)),
    "decode-m1-16rows": (1, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, WAVES=4, GROUP_M=1)),  # g32: gather decode
    "decode-dot-split": (5, dict(BLOCK_N=16, BLOCK_K=32, WAVES=8, GROUP_M=1)),
    "decode-dot-bk64": (16, dict(BLOCK_N=32, BLOCK_K=64, WAVES=2, GROUP_M=1)),
    "gemm-nosplit": (33, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, WAVES=0, GROUP_M=2)),
    "gemm-split": (17, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, WAVES=4, GROUP_M=8)),
    "gemm-m118": (118, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, WAVES=1, GROUP_M=2)),  # ragged last row tile
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bits,dtype", [(4, torch.float16), (2, torch.bfloat16), (8, torch.float16),
                                        (3, torch.bfloat16)])
def test_pinned_paths(device, path, bits, dtype):
    m, config = PATHS[path]
    k, n = 160, 72
    layer = make_layer(k, n, bits, 32, zero_offset=1, bias=True, device=device, seed=bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(bits)).to(device, dtype)
    half2 = config.get("HALF2", False) and bits == 4 and dtype == torch.float16
    assert_close_to_reference(run(x, layer, bits, k, 1, config), x, layer, bits, k, 1, half2=half2)


# The mma.sync tiles (BLOCK_M 16: 1 <= M <= 16; 32: GEMM) that take one tl.dot per code position (4- and
# 8-bit, one group per tile, BLOCK_K / codes per word >= 16): K past the last full tile, one group or g128,
# split-K on and off, ragged M and N. Swapping two of the x slices in triton_decode.x_by_code fails every
# case of that width.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,k,bits,block_k,gs,sym,zo,bias,dtype,waves", [
    (16, 300, 4, 128, 128, False, 1, True, torch.float16, 4), (5, 256, 4, 128, -1, True, 0, False, torch.bfloat16, 0),
    (2, 300, 4, 128, 128, True, 1, True, torch.bfloat16, 0), (9, 384, 4, 128, 128, False, 0, False, torch.float16, 8),
    (40, 300, 4, 128, 128, True, 0, True, torch.float16, 0), (17, 256, 4, 128, -1, False, 1, False, torch.bfloat16, 4),
    (16, 300, 8, 64, 128, False, 1, True, torch.bfloat16, 4), (3, 200, 8, 128, -1, True, 0, False, torch.float16, 0),
    (33, 300, 8, 64, 128, False, 0, True, torch.float16, 2),
    (1, 300, 4, 128, 128, True, 1, True, torch.float16, 4), (1, 256, 8, 64, -1, False, 0, False, torch.bfloat16, 0)])
def test_tiles_by_code_position(device, m, k, bits, block_k, gs, sym, zo, bias, dtype, waves):
    layer = make_layer(k, 72, bits, gs, sym, zo, bias=bias, device=device, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    config = dict(BLOCK_N=32, BLOCK_K=block_k, WAVES=waves, GROUP_M=1)
    if m > triton_gptq_ops.DECODE_MAX_M:
        config["BLOCK_M"] = 32
    if m == 1:   # the M = 1 launch on a 16-row tile (M1_CONFIGS offers these to the autotuner)
        config["BLOCK_M"] = 16
    assert_close_to_reference(run(x, layer, bits, k, zo, config), x, layer, bits, k, zo)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,n,gs,sym,zo,bias,x_max", [
    (100, 40, 32, False, 1, True, 3.0), (200, 70, 32, True, 0, False, 3.0), (96, 40, -1, False, 0, True, 3.0),
    (100, 40, 32, False, 1, False, 60000.0),   # |x| near fp16's max: the 2^-6 prescale must prevent overflow
    (200, 70, 48, False, 1, True, 3.0),        # not uniform: HALF2 falls back to the FMA path
])
def test_m1_half2_path(device, k, n, gs, sym, zo, bias, x_max):
    layer = make_layer(k, n, 4, gs, sym, zo, bias=bias, device=device, seed=k + n)
    if x_max > 100:  # keep the outputs themselves finite in fp16
        layer["scales"] = (layer["scales"].float() * 1e-4).half()
    gen = torch.Generator().manual_seed(k)
    x = ((torch.rand(1, k, generator=gen) * 2 - 1) * x_max).to(device, torch.float16)
    config = dict(BLOCK_N=32, BLOCK_K=32, WAVES=4, GROUP_M=1, HALF2=True)
    assert_close_to_reference(run(x, layer, 4, k, zo, config), x, layer, 4, k, zo, half2=gs != 48)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_is_deterministic_and_counters_reset(device):
    """The last-arriving slice sums partials in a fixed order; counters must return to zero."""
    layer = make_layer(96, 40, 4, 32, device=device)
    config = dict(BLOCK_N=16, BLOCK_K=32, WAVES=8, GROUP_M=1)
    x = torch.randn(3, 96).to(device, torch.float16)
    first = run(x, layer, 4, 96, 1, config)
    other = make_layer(64, 24, 4, 32, device=device, seed=1)  # different tiling in between
    run(torch.randn(2, 64).to(device, torch.float16), other, 4, 64, 1, config)
    assert torch.equal(first, run(x, layer, 4, 96, 1, config))
    for _, locks in triton_gptq_ops._WORKSPACES.values():
        assert int(locks.abs().sum()) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_triton_backend_batched_input(device):
    k, n = 64, 48
    layer = make_layer(k, n, 4, 32, bias=True, device=device)
    x = torch.randn(2, 3, k).to(device, torch.float16)
    y = gptq_linear(x, layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], 4, k,
                    layer["bias"], zero_offset=1, backend="triton")
    assert y.shape == (2, 3, n)
    assert_close_to_reference(y.reshape(6, n), x.reshape(6, k), layer, 4, k, 1)


# Dequantize kernel (prefill path): bits x zero_offset x dtype x group layout, K / N awkward.
# K = 200 / 100 is not a multiple of BLOCK_K (32, 64), of group size 48, nor (2-bit) of the pack
# unit 16; N = 70 / 40 is not a multiple of BLOCK_N. gs 32 with BLOCK_K 32 is the uniform mode,
# gs 32 with BLOCK_K 64 must fall back to gathering, 48 / act-order gather, -1 is one group.
DEQUANT_CASES = [  # bits, gs, act, zo, dtype, BLOCK_K, BLOCK_N
    (4, 32, False, 1, torch.float16, 32, 32), (4, 48, False, 0, torch.bfloat16, 32, 64),
    (4, 32, True, 0, torch.float16, 64, 32), (4, 32, False, 1, torch.bfloat16, 64, 32),
    (2, 32, False, 0, torch.float16, 32, 32), (2, -1, False, 1, torch.bfloat16, 64, 64),
    (2, 48, True, 1, torch.float16, 32, 32), (8, 32, False, 0, torch.bfloat16, 32, 32),
    (8, -1, False, 1, torch.float16, 32, 64), (8, 48, True, 0, torch.float16, 64, 32),
    (3, 32, False, 1, torch.float16, 32, 32), (3, 48, True, 0, torch.bfloat16, 64, 32),
    (3, -1, False, 0, torch.float16, 64, 64),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,gs,act,zo,dtype,block_k,block_n", DEQUANT_CASES,
                         ids=[f"b{c[0]}-g{c[1]}{'-act' if c[2] else ''}-zo{c[3]}-{str(c[4])[6:]}-bk{c[5]}-bn{c[6]}"
                              for c in DEQUANT_CASES])
def test_dequant_kernel_bit_exact(device, bits, gs, act, zo, dtype, block_k, block_n):
    """W^T from the Triton dequantize kernel equals reference.dequantize_weight bit for bit: both take
    the exact fp32 product of an fp16 scale and an integer below 2^8 and round it once to `dtype`."""
    k, n = (200, 70) if gs != 32 else (100, 40)
    layer = make_layer(k, n, bits, gs, zero_offset=zo, act_order=act, device=device, seed=bits + gs)
    args = (layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k, zo)
    w = dequantize_triton(*args, dtype, config=dict(BLOCK_K=block_k, BLOCK_N=block_n))
    ref = dequantize_weight(*args, dtype=dtype)
    assert w.dtype == dtype and w.shape == (k, n)
    assert torch.equal(w, ref)


def _pin_gpu_dequant_config(device, monkeypatch):
    """GPU cases: one fixed dequantize config instead of autotuning every layout (compile time);
    test_cuda_autotuned_awkward_shapes covers the autotuned kernel."""
    if device == "cuda":
        from quantkit.kernels import triton_dequant

        real = triton_dequant.dequantize_checked
        monkeypatch.setattr(triton_dequant, "dequantize_checked",
                            lambda *a, **kw: real(*a, **kw, config=dict(BLOCK_K=32, BLOCK_N=64)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,gs,act,bias,dtype", [(4, 32, False, True, torch.float16),
                                                     (2, 48, True, False, torch.bfloat16),
                                                     (8, -1, False, True, torch.bfloat16),
                                                     (3, 32, False, True, torch.float16)])
def test_prefill_path_matches_reference(device, bits, gs, act, bias, dtype, monkeypatch):
    """gptq_linear's large-M path (dequantize + GEMM, forced here at a small M) and the fused path."""
    _pin_gpu_dequant_config(device, monkeypatch)
    k, n = 100, 40
    layer = make_layer(k, n, bits, gs, zero_offset=1, act_order=act, bias=bias, device=device, seed=bits)
    x = torch.randn(3, 7, k, generator=torch.Generator().manual_seed(bits)).to(device, dtype)
    args = (layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k, layer["bias"], 1)
    for path in ("prefill", "fused"):
        y = gptq_linear(x, *args, backend="triton", path=path)
        assert y.shape == (3, 7, n)
        assert_close_to_reference(y.reshape(-1, n), x.reshape(-1, k), layer, bits, k, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_auto_path_switches_at_prefill_min_m(device, monkeypatch):
    _pin_gpu_dequant_config(device, monkeypatch)
    layer = make_layer(64, 32, 4, 32, device=device)
    args = (layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], 4, 64)
    calls = []
    real = dispatch._prefill
    monkeypatch.setattr(dispatch, "_prefill", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(dispatch, "PREFILL_MIN_M", 6)
    for m in (5, 6, 9):
        x = torch.randn(m, 64).to(device, torch.float16)
        assert_close_to_reference(gptq_linear(x, *args, backend="triton"), x, layer, 4, 64, 1)
    assert calls == [6, 9]
    assert dispatch.choose_path(1000, "fused") == "fused" and dispatch.choose_path(1, "prefill") == "prefill"


@pytest.mark.skipif(triton_gptq_ops is None, reason="triton unavailable")
def test_dequant_and_path_error_messages():
    layer = make_layer(64, 32, 4, 32)
    good = (layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"])
    with pytest.raises(ValueError, match="bits 2, 3, 4, 8"):
        dequantize_triton(*good, 5, 64, 1, torch.float16)
    with pytest.raises(ValueError, match="dtype must be"):
        dequantize_triton(*good, 4, 64, 1, torch.float32)
    with pytest.raises(ValueError, match="zero_offset"):
        dequantize_triton(*good, 4, 64, 2, torch.float16)
    with pytest.raises(ValueError, match="qweight must be torch.int32"):
        dequantize_triton(good[0][:-1], *good[1:], 4, 64, 1, torch.float16)
    with pytest.raises(ValueError, match="scales must be float16"):
        dequantize_triton(*good[:2], good[2].float(), good[3], 4, 64, 1, torch.float16)
    with pytest.raises(ValueError, match="path must be"):
        gptq_linear(torch.randn(2, 64).half(), *good, 4, 64, path="fast")
    if INTERPRET:
        bad_g = layer["g_idx"].clone()
        bad_g[5] = 7
        with pytest.raises(ValueError, match="g_idx values"):
            dequantize_triton(*good[:3], bad_g, 4, 64, 1, torch.float16)
        with pytest.raises(ValueError, match=r"x must be \[..., in_features=64\]"):
            gptq_linear(torch.randn(4, 32).half(), *good, 4, 64, backend="triton")
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            gptq_linear(torch.randn(200, 64), *good, 4, 64, backend="triton", path="prefill")


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (compiled Triton)")
def test_cuda_autotuned_awkward_shapes():
    """The real entry point on GPU: autotuned decode and GEMM, M = 118, SmolLM2-like K = 576."""
    k, n = 576, 1000
    for m, gs, act, bits in [(1, 128, False, 4), (7, 128, True, 4), (118, 128, False, 4), (118, 48, False, 4),
                             (300, 128, False, 4), (260, 48, True, 4),  # these two: prefill path
                             (1, 128, False, 3), (300, 128, False, 3)]:
        layer = make_layer(k, n, bits, gs, act_order=act, bias=True, device="cuda", seed=m)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        y = gptq_linear(x, layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k,
                        layer["bias"], zero_offset=1)
        assert_close_to_reference(y, x, layer, bits, k, 1)


def test_dispatch_cpu_defaults_to_torch_and_3bit():
    k, n = 70, 36
    for bits in (3, 4):
        layer = make_layer(k, n, bits, 32, bias=True)
        x = torch.randn(4, k, dtype=torch.bfloat16)
        args = (layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k, layer["bias"], 1)
        assert torch.equal(gptq_linear(x, *args), gptq_linear_torch(x, *args))


def test_dispatch_rejects_bad_backend_and_bits():
    layer = make_layer(64, 32, 3, 32)
    args = (layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], 3, 64)
    with pytest.raises(ValueError, match="backend"):
        gptq_linear(torch.randn(1, 64).half(), *args, backend="cuda-magic")
    if triton_gptq_ops is not None and INTERPRET:
        with pytest.raises(ValueError, match="bits 2, 3, 4, 8"):
            gptq_linear(torch.randn(1, 64).half(), *args[:4], 5, 64, backend="triton")


@pytest.mark.skipif(triton_gptq_ops is None, reason="triton unavailable")
def test_wrapper_error_messages():
    layer = make_layer(64, 32, 4, 32)
    good = (layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], 4, 64)
    x = torch.randn(2, 64).half()
    with pytest.raises(ValueError, match=r"x must be \[M, in_features=64\]"):
        gptq_matmul(torch.randn(2, 63).half(), *good)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gptq_matmul(x.float(), *good)
    with pytest.raises(ValueError, match="scales must be float16"):
        gptq_matmul(x, good[0], good[1], good[2].float(), *good[3:])
    with pytest.raises(ValueError, match="qweight must be"):
        gptq_matmul(x, good[0][:-1], *good[1:])
    with pytest.raises(ValueError, match="zero_offset"):
        gptq_matmul(x, *good, zero_offset=2)
    if INTERPRET:
        bad_g = layer["g_idx"].clone()
        bad_g[5] = 7
        with pytest.raises(ValueError, match="g_idx values"):
            gptq_matmul(x, *good[:3], bad_g, 4, 64)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_reference_decoders_agree(bits):
    """The fast int32 unpack and the reference dequant agree with the format module's decoders."""
    k, n = 100, 24
    layer = make_layer(k, n, bits, 32, zero_offset=1, act_order=True)
    assert torch.equal(bitpack.unpack(layer["qweight"], bits, k), bitpack.unpack_stream(layer["qweight"], bits, k))
    w = dequantize_weight(layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k, 1,
                          dtype=torch.float32)
    expect = dequantize_gptq(layer, bits, k, "gptq").t()
    assert torch.equal(w, expect)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_quant_linear_cpu_matches_reference(dtype, fmt):
    k, n, bits, gs = 72, 40, 4, 32
    zo = gptq.V1_ZERO_OFFSET[fmt]
    layer = make_layer(k, n, bits, gs, zero_offset=zo, bias=True)
    mod = QuantLinear(k, n, bits, gs, bias=True, checkpoint_format=fmt)
    for name in ("qweight", "qzeros", "scales", "g_idx", "bias"):
        getattr(mod, name).copy_(layer[name])
    x = torch.randn(2, 5, k, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = gptq_linear_torch(x, mod.qweight, mod.qzeros, mod.scales, mod.g_idx, bits, k, mod.bias, zo)
    y = mod(x)
    assert y.dtype == dtype and y.shape == (2, 5, n)
    # Same decoded weights; the strip and cached paths sum in another order (an fp32 GEMM for fp16/bf16 on CPU,
    # whose blocking depends on the CPU's vector width), and all round twice (matmul, then + bias): they may differ
    # by an ulp of the output's scale, plus fp32's summation-order bound over the k products (k u sum |x w|).
    def tol(r):
        w = dequantize_gptq(dict(layer, scales=mod.scales), bits, k, fmt)  # the buffers as they are now
        order = k * 2.0**-24 * float((x.float().abs() @ w.abs().t()).max())
        return dict(rtol=0, atol=2 * UNIT_ROUNDOFF.get(dtype, 2.0**-24) * float(r.abs().max()) + order)

    torch.testing.assert_close(y, ref, **tol(ref))
    assert "_weight_cache" not in mod.__dict__  # the default keeps no decoded copy
    mod.cache_dequantized = True
    torch.testing.assert_close(mod(x), ref, **tol(ref))
    # The cached decode must follow in-place changes of the buffers.
    mod.scales.mul_(2)
    ref2 = gptq_linear_torch(x, mod.qweight, mod.qzeros, mod.scales, mod.g_idx, bits, k, mod.bias, zo)
    torch.testing.assert_close(mod(x), ref2, **tol(ref2))
    mod.cache_dequantized = False
    torch.testing.assert_close(mod(x), ref2, **tol(ref2))


@pytest.mark.skipif(triton_gptq_ops is None, reason="triton unavailable")
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (7, 28672, 8192), (64, 4096, 14336), (2048, 576, 1536)])
def test_workspace_covers_every_tuned_config(m, n, k):
    """The autotuner may pick any config: the cached workspace must fit the largest split-K of all."""
    from quantkit.kernels.triton_gptq import split_k

    kind = 1 if m == 1 else 16 if m <= triton_gptq_ops.DECODE_MAX_M else 0
    _, configs = triton_gptq_ops._TUNED[kind]
    block_m = {1: None, 16: 16, 0: None}[kind]   # M = 1 configs name their BLOCK_M (1 or 16), as GEMM's do
    partials, counters = triton_gptq_ops._workspace_size(m, n, k, configs, block_m, 132)
    for c in map(dict, configs):
        bm = block_m or c["BLOCK_M"]
        splits = split_k(m, n, k, bm, c["BLOCK_N"], c["BLOCK_K"], 132, c["WAVES"])
        if splits > 1:
            assert splits * m * n <= partials
            assert -(-m // bm) * -(-n // c["BLOCK_N"]) <= counters


@pytest.mark.skipif(triton_gptq_ops is None, reason="triton unavailable")
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (576, 1536), (128, 256)])
def test_the_reserved_workspace_covers_every_m(n, k):
    """Under CUDA graphs the workspace must not grow after the layers reserve it (triton_gptq_ops.workspace): the
    bound, taken at a few M, must cover every M of every launch kind, GPTQ and codebook, on an H100's 132 SMs."""
    from quantkit.kernels import triton_codebook

    gptq_bound = triton_gptq_ops.workspace_bound(n, k, 132)
    codebook_bound = triton_codebook.workspace_bound(n, k, 132)
    for m in range(1, 64 * 132 * triton_codebook.WAVES + 65):  # past the last M that splits, for both
        kind = 1 if m == 1 else 16 if m <= triton_gptq_ops.DECODE_MAX_M else 0
        _, configs = triton_gptq_ops._TUNED[kind]
        need = triton_gptq_ops._workspace_size.__wrapped__(m, n, k, configs, 16 if kind == 16 else None, 132)
        assert need[0] <= gptq_bound[0] and need[1] <= gptq_bound[1], m
        _, partials, counters = triton_codebook.split_for(m, n, k, 132)
        assert partials <= codebook_bound[0] and counters <= codebook_bound[1], m
    assert gptq_bound[0] > 0 and codebook_bound[0] > 0  # both split at M = 1 on these shapes


@pytest.mark.skipif(triton_gptq_ops is None, reason="triton unavailable")
def test_use_m1_configs_swaps_candidates_and_resizes_the_workspace():
    from quantkit.kernels import triton_gptq

    before = list(triton_gptq.m1_kernel.configs)
    wider = triton_gptq.M1_CONFIGS + triton_gptq.M1_HALF2_CONFIGS
    try:
        triton_gptq_ops.use_m1_configs(wider)
        _, configs = triton_gptq_ops._TUNED[1]
        assert triton_gptq.m1_kernel.configs == wider and len(configs) == len(wider)
        partials, _ = triton_gptq_ops._workspace_size(1, 4096, 4096, configs, None, 132)
        for c in triton_gptq.M1_HALF2_CONFIGS:
            assert triton_gptq.split_k(1, 4096, 4096, 1, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], 132,
                                       c.kwargs["WAVES"]) * 4096 <= partials
    finally:
        triton_gptq_ops.use_m1_configs(before)
    assert triton_gptq_ops._TUNED[1][1] == triton_gptq_ops._items(before)


@pytest.mark.skipif(not PREIMPORTED or torch.cuda.is_available(),
                    reason="the interpreter cases already ran in this process (or a GPU runs the real ones)")
def test_interpreter_cases_in_fresh_process():
    """Triton was imported before this module could turn the interpreter on: rerun it in a new one."""
    rerun_with_interpreter(__file__, timeout=900)


def test_launches_run_on_their_tensors_gpu(monkeypatch):
    """Every Triton launch in quantkit.kernels sits under on_device(...), which makes the tensors' GPU current
    when another one is (Triton launches on the current device)."""
    import ast
    import contextlib
    from pathlib import Path

    from quantkit.kernels import device as kd

    class FakeCuda:
        is_cuda, device = True, torch.device("cuda", 1)

    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: (entered.append(d), contextlib.nullcontext())[1])
    with kd.on_device(FakeCuda()):
        pass
    assert entered == [torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with kd.on_device(FakeCuda()), kd.on_device(torch.zeros(1)):
        pass
    assert len(entered) == 1  # already current, or a CPU tensor: no guard

    root = Path(kd.__file__).parent
    unguarded = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = {id(n) for w in ast.walk(tree) if isinstance(w, ast.With)
                   and any("on_device" in ast.unparse(item.context_expr) for item in w.items)
                   for n in ast.walk(w)}
        for node in ast.walk(tree):  # kernel[grid](...): a call of a subscript
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and id(node) not in guarded:
                unguarded.append(f"{path.name}:{node.lineno}")
    assert not unguarded, unguarded


def test_layers_reserve_the_split_k_workspace_when_they_move(monkeypatch):
    """QuantLinear and a kernel-decoded DecodedLinear ask for their shape's workspace whenever they move (on a GPU
    that allocates it before any CUDA graph is captured; on the CPU the call does nothing)."""
    from quantkit.nn import decoded_linear, quant_linear
    from quantkit.schemes.turboquant import TurboQuant

    calls = []
    for module in (quant_linear, decoded_linear):
        monkeypatch.setattr(module, "reserve_workspace",
                            lambda device, n, k, codebook=False: calls.append((device.type, n, k)))
    QuantLinear(64, 48, 4, 32, bias=False).to("cpu")
    decoded_linear.DecodedLinear(96, 40, TurboQuant(4, 32), 32, 3, bias=False, dtype=torch.float32).to("cpu")
    assert calls == [("cpu", 48, 64), ("cpu", 40, 96)]
    before = dict(getattr(triton_gptq_ops, "_WORKSPACES", {}))
    monkeypatch.undo()
    QuantLinear(64, 48, 4, 32, bias=False).to("cpu")
    assert dict(getattr(triton_gptq_ops, "_WORKSPACES", {})) == before

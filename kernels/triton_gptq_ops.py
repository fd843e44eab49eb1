"""Launch wrapper for the GPTQ Triton kernels (kernels/triton_gptq.py): check, allocate, launch.

gptq_matmul() validates shapes / dtypes / devices with clear ValueErrors, inspects g_idx once
(uniform `k // group_size` or arbitrary), picks the launch shape (M = 1 FMA, M <= 16 decode,
GEMM), sizes the cached split-K workspace, and launches the autotuned kernel (or a pinned config:
CPU tensors under TRITON_INTERPRET=1, and tests).
"""
import functools

import torch
import triton

from quantkit.core import bitpack
from quantkit.kernels.device import on_device
from quantkit.kernels.triton_gptq import (DECODE_CONFIGS, GEMM_CONFIGS, M1_CONFIGS, decode_kernel, gemm_kernel,
                                          m1_kernel, split_k, untuned_kernel)

DECODE_MAX_M = 16     # M up to this is memory-bound: decode launch shape
_MIN_BLOCK_K = 32     # smallest BLOCK_K in the configs; uniform mode needs it to divide the group size
_ONE_GROUP = 1 << 30  # group size for a single group (-1): a multiple of every BLOCK_K
_INTERPRETER_SMS = 4  # pretend SM count on CPU, small so interpreter runs still exercise split-K
_WORKSPACES = {}      # device -> (fp32 partials, int32 tile counters); counters reset themselves
_NUM_SMS = {}


def group_layout(g_idx: torch.Tensor, n_groups: int):
    """(uniform, group_size): uniform when g_idx[k] == k // group_size (or one group).

    Checking costs a device sync, so the answer is cached on the tensor itself and trusted until
    the tensor is modified in place (its _version changes)."""
    cached = getattr(g_idx, "_quantkit_group_layout", None)
    if cached is not None and cached[0] == g_idx._version:
        return cached[1]
    result = _inspect_g_idx(g_idx, n_groups)
    g_idx._quantkit_group_layout = (g_idx._version, result)
    return result


def _inspect_g_idx(g_idx, n_groups):
    lo, hi = int(g_idx.min()), int(g_idx.max())
    if lo < 0 or hi >= n_groups:
        raise ValueError(f"g_idx values must lie in [0, {n_groups}) (scales has {n_groups} groups), "
                         f"got [{lo}, {hi}]")
    if n_groups == 1:
        return True, _ONE_GROUP
    gs = int((g_idx == 0).sum())
    ramp = torch.arange(g_idx.numel(), device=g_idx.device, dtype=torch.int32) // gs
    if gs % _MIN_BLOCK_K == 0 and torch.equal(g_idx, ramp):
        return True, gs
    return False, 0


def check_packed(qweight, qzeros, scales, g_idx, bits, k, zero_offset, bias=None, device=None, device_of="qweight"):
    """ValueError unless the GPTQ-layout tensors fit the Triton kernels: bits, zero offset, dtypes,
    shapes for in_features = k, contiguity, and all on `device` (default: qweight's, named
    `device_of` in the message)."""
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"Triton GPTQ kernels support bits 2, 3, 4, 8; got {bits}")
    if scales.dim() != 2 or scales.dtype != torch.float16:
        raise ValueError(f"scales must be float16 [groups, out_features], got {scales.dtype} {tuple(scales.shape)}")
    groups, n = scales.shape
    expect = {"qweight": (qweight, torch.int32, (bitpack.packed_len(k, bits), n)),
              "qzeros": (qzeros, torch.int32, (groups, bitpack.packed_len(n, bits))),
              "g_idx": (g_idx, torch.int32, (k,))}
    if bias is not None:
        expect["bias"] = (bias, bias.dtype if bias.is_floating_point() else torch.float16, (n,))
    for name, (t, dtype, shape) in expect.items():
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {dtype} {shape} for in_features={k}, out_features={n}, "
                             f"bits={bits}; got {t.dtype} {tuple(t.shape)}")
    device = device or qweight.device
    for name, t in [("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx),
                    ("bias", bias)]:
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {device_of} is on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if zero_offset not in (0, 1):
        raise ValueError(f"zero_offset must be 0 (gptq_v2) or 1 (gptq v1), got {zero_offset}")


def check_layer(x, qweight, qzeros, scales, g_idx, bits, k, bias, zero_offset):
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, in_features={k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along in_features")
    check_packed(qweight, qzeros, scales, g_idx, bits, k, zero_offset, bias, x.device, "x")


def num_sms(device):
    if device.type != "cuda":
        return _INTERPRETER_SMS
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def workspace(device, partials, counters):
    """The split-K scratch of a device, grown on demand: every launch there shares it, as launches on one stream
    run in order (quantkit's layers run on one stream at a time). Under CUDA graphs it must not grow: memory
    allocated while torch.compile's CUDA-graph trees warm up lands in their pool, and a tensor left alive there is
    an error, so the layers reserve what their shapes can ask for when they move to the GPU
    (dispatch.reserve_workspace)."""
    ws, locks = _WORKSPACES.get(device, (None, None))
    if ws is None or ws.numel() < partials:
        ws = torch.empty(max(partials, 1), dtype=torch.float32, device=device)
    if locks is None or locks.numel() < counters:
        locks = torch.zeros(max(counters, 1), dtype=torch.int32, device=device)
    _WORKSPACES[device] = (ws, locks)
    return ws, locks


@functools.lru_cache(maxsize=256)
def workspace_bound(n, k, sms):
    """(partials, counters): the most any M and any tuned config asks of an [n, k] layer. Split-K stops once the
    tiles fill the GPU, and for a fixed number of row tiles the need grows with M, so the M that matter are 1, 16
    and the multiples of 16 (every BLOCK_M divides them) up to where the largest tiles fill the SMs."""
    size = _workspace_size.__wrapped__  # not through its cache, which holds the shapes that run
    bounds = [size(1, n, k, _TUNED[1][1], None, sms), size(16, n, k, _TUNED[16][1], 16, sms)]
    largest_m = max(dict(c)["BLOCK_M"] for c in _TUNED[0][1]) * sms
    bounds += [size(m, n, k, _TUNED[0][1], None, sms) for m in range(32, largest_m + 1, 16)]
    return tuple(map(max, zip(*bounds)))


def _m_bucket(m):
    return 1 << max(0, (m - 1).bit_length())  # autotune once per power of two, not per prompt length


def _interpreter_config(decode):
    # Small tiles: the interpreter runs numpy per program; these still cover split-K and tl.dot.
    return dict(BLOCK_N=32, BLOCK_K=32, WAVES=2, GROUP_M=2, **({} if decode else {"BLOCK_M": 16}))


def gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, in_features, bias=None, zero_offset=1, *,
                config=None):
    """y [M, N] = x [M, K] @ W^T (+ bias) in x.dtype, W decoded in registers from GPTQ tensors.

    M <= 16 takes the decode launch (split-K), larger M the tiled GEMM. `config` pins the
    meta-parameters (BLOCK_N, BLOCK_K, WAVES, GROUP_M, optional BLOCK_M, num_warps, num_stages)
    instead of autotuning; CPU tensors (TRITON_INTERPRET=1) always use a pinned config."""
    check_layer(x, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
    m, k = x.shape
    groups, n = scales.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    uniform, gs = group_layout(g_idx, groups)
    decode = m <= DECODE_MAX_M
    gemv = m == 1 and bits != 3   # the M = 1 FMA shape reads whole codes from single words
    meta = dict(BITS=bits, ZERO_OFFSET=zero_offset, HAS_BIAS=bias is not None,
                IS_FP16=x.dtype == torch.float16)
    if x.device.type != "cuda":
        config = config or _interpreter_config(decode)
        meta["INTERPRETER"] = True
    if decode and config is not None:   # pinned: 1 row (FMA tile) at M = 1, else 16, unless the config says
        config = {"BLOCK_M": 1 if gemv else 16, **config}
    elif decode and not gemv:           # tl.dot needs 16 rows; M = 1's tuned configs name their own BLOCK_M
        meta["BLOCK_M"] = 16
    sms = num_sms(x.device)
    if config is not None:
        kernel = untuned_kernel
        uniform = uniform and gs % config["BLOCK_K"] == 0
        sizes = _workspace_size(m, n, k, (tuple(config.items()),), meta.get("BLOCK_M"), sms)
    else:
        kernel, configs = _TUNED[1 if gemv else 16 if decode else 0]
        sizes = _workspace_size(m, n, k, configs, meta.get("BLOCK_M"), sms)
    meta["UNIFORM"] = uniform
    ws, locks = workspace(x.device, *sizes)
    grid = lambda a: (triton.cdiv(m, a["BLOCK_M"]) * triton.cdiv(n, a["BLOCK_N"]), a["SPLIT_K"])  # noqa: E731
    with on_device(x):
        kernel[grid](
            x_ptr=x, qw_ptr=qweight, qz_ptr=qzeros, s_ptr=scales, g_ptr=g_idx,
            b_ptr=bias if bias is not None else y, y_ptr=y, ws_ptr=ws, lock_ptr=locks,
            M=m, N=n, K=k, KW=qweight.shape[0], NW=qzeros.shape[1], GS=gs if uniform else 1,
            stride_xm=x.stride(0), stride_ym=y.stride(0), M_BUCKET=_m_bucket(m), NUM_SMS=sms,
            **meta, **(config or {}))
    return y


@functools.lru_cache(maxsize=4096)  # per shape: keeps the per-call Python cost down
def _workspace_size(m, n, k, candidates, block_m, num_sms):
    """Upper bounds over the candidate configs (tuples of items): fp32 partials and tile counters."""
    partials = counters = 0
    for c in map(dict, candidates):
        bm = block_m or c["BLOCK_M"]
        splits = split_k(m, n, k, bm, c["BLOCK_N"], c["BLOCK_K"], num_sms, c["WAVES"])
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, c["BLOCK_N"])
        if splits > 1:
            partials, counters = max(partials, splits * m * n), max(counters, tiles)
    return partials, counters


def _items(configs):
    return tuple(tuple(c.all_kwargs().items()) for c in configs)


# Launch kind (0: GEMM, 1: M = 1, 16: 2 <= M <= 16) -> (autotuned kernel, hashable configs).
_TUNED = {0: (gemm_kernel, _items(GEMM_CONFIGS)), 1: (m1_kernel, _items(M1_CONFIGS)),
          16: (decode_kernel, _items(DECODE_CONFIGS))}


def use_m1_configs(configs):
    """Replace the M = 1 autotune candidates, e.g. M1_CONFIGS + M1_HALF2_CONFIGS (benchmarks): the
    autotuner forgets its picks and the split-K workspace is sized for the new tiles."""
    m1_kernel.configs = list(configs)
    m1_kernel.cache.clear()
    _TUNED[1] = (m1_kernel, _items(configs))
    workspace_bound.cache_clear()

"""Exact Viterbi search of the bitshift trellis (quantkit.schemes.trellis_codes), vectorized over many sequences.

The search finds, per sequence x [n, V] (n steps of V weights), the state path s_0 .. s_(n-1) of least weighted squared
error Σ_t Σ_v w_tv (x_tv - value(s_t)_v)². The states of step t that can follow state s are ((s << kV) | b) mod 2^L:
the predecessors of s' are the 2^kV states top·2^(L-kV) + (s' >> kV). So with the costs of step t-1 laid out as
[P = 2^kV, M = 2^(L-kV)] (top, then the shared bits), the best predecessor of every s' is a min over the first axis,
and step t's costs, laid out as [M, P], are that min plus each state's own distortion. Per step: one min over the
predecessor axis (amin, without indices), the min broadcast into the new costs, one small matmul added to them (the
distortion of all 2^L states at once: Σ_v w c_v² - 2 w x_v c_v; the x² term is the same for every state and added
back at the end). No backpointers: torch's min with indices costs ~10x amin on CPU, so the search keeps each step's
[sequences, M] best predecessor costs (float32, 4 bytes where a uint8 backpointer would be 1) and the backtrack
recomputes, for the one state per sequence on the path, the P costs its predecessor was chosen from (a gather). The
memory per chunk of sequences is bounded (chunk_size).

On the CPU the same search runs in C (trellis_viterbi.c, built on first use by quantkit.core.native): sixteen
sequences at once, one per vector lane, each step one loop that folds the new costs into the next step's
best-predecessor costs and keeps one-byte backpointers, with no pass over memory per op. 5-10x faster than the torch
ops on the project's CPU (scripts/bench_distortion.py); the torch path stays for GPUs and machines without a C
compiler, and as the reference the tests hold the C search to.

Tail-biting (the sequence's last state wraps to its first, so the first state costs no extra bits: the L - kV bits
it shares with the last state, its "overlap", are the last state's low bits):
  tail_biting       QTIP's approximation (its Algorithm 4 in spirit): one unconstrained search of the sequence rotated
                    by n/2 steps, whose state at the wrap point gives the overlap; then one exact search constrained to
                    start with that overlap as the first state's high bits and end with it as the last state's low
                    bits. Two searches; the result is a valid tail-biting path, not always the best one.
  tail_biting_exact every overlap tried (2^(L-kV) constrained searches), the best kept: the exact tail-biting optimum,
                    for small L (tests, and measuring the approximation).
"""
import ctypes
from functools import cache
from pathlib import Path

import torch

from quantkit.core import native

INF = float("inf")
# Sequences per chunk x states: on CPU a cost tensor of 4 MB, near the cache; on a GPU one of 256 MB, enough work per
# kernel launch. The per-step predecessor costs of a chunk stay within PATH_BYTES.
CHUNK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 26}
PATH_BYTES = {"cpu": 1 << 28, "cuda": 1 << 31}
# The C search's backpointers per group of lanes ([n, M, lanes] bytes); a search that needs more runs in torch.
NATIVE_BACK_BYTES = 1 << 30


def distortion_matrix(table: torch.Tensor) -> torch.Tensor:
    """[2V, N]: rows c_v² then c_v of the N states' values table [N, V] (float32), the right factor of the
    per-step distortion product."""
    t = table.to(torch.float32)
    return torch.cat([(t * t).t(), t.t()]).contiguous()


def step_features(x: torch.Tensor, weights) -> torch.Tensor:
    """[n, B, 2V]: the left factor (w_v, -2 w_v x_v) of each step's distortion, x [B, n, V], weights like x or None."""
    w = torch.ones_like(x) if weights is None else weights.to(x.dtype)
    return torch.cat([w, -2 * w * x], dim=-1).transpose(0, 1).contiguous()


def _search(feat, dist, L, kV, start, end):
    """One chunk's forward pass and backtrack; feat [n, B, 2V], dist [2V, N]; start/end [B] overlaps or None.
    Returns (states [B, n] int64, cost [B] without the Σ w x² term).

    Step t's cost of state s is d_t(s) + pre[t][s >> kV]: pre[t] [B, M] is the best cost of the predecessors (a min
    without indices: torch's min with indices costs 10x amin), the start mask for t = 0. The backtrack recomputes,
    for the one state per sequence on the path, the P costs its predecessor was chosen from."""
    n, B = feat.shape[:2]
    P, M = 1 << kV, 1 << (L - kV)
    shared = torch.arange(M, device=feat.device)
    pre = torch.zeros(n, B, M, device=feat.device)
    if start is not None:  # the first state's high bits are the overlap
        pre[0].masked_fill_(shared[None] != start[:, None], INF)
    acc = torch.empty(B, 1 << L, device=feat.device)
    for t in range(n):
        if t:
            torch.amin(acc.view(B, P, M), dim=1, out=pre[t])
        acc.view(B, M, P).copy_(pre[t][:, :, None].expand(B, M, P))  # then one addmm: 25 % faster than mm + add
        acc.addmm_(feat[t], dist)
    if end is not None:  # the last state's low bits are the overlap
        acc.view(B, P, M).masked_fill_((shared[None] != end[:, None])[:, None], INF)
    cost, s = acc.min(dim=1)
    states = torch.empty(B, n, dtype=torch.int64, device=feat.device)
    states[:, n - 1] = s
    tops = torch.arange(P, device=feat.device) * M
    rows = torch.arange(B, device=feat.device)[:, None]
    for t in range(n - 1, 0, -1):
        m = s >> kV
        cand = tops + m[:, None]                                     # [B, P]: the predecessors of s
        d = (feat[t - 1][:, None, :] * dist.t()[cand]).sum(dim=-1)  # their distortion at step t - 1
        s = cand.gather(1, (d + pre[t - 1][rows, cand >> kV]).argmin(dim=1, keepdim=True))[:, 0]
        states[:, t - 1] = s
    return states, cost


@cache
def native_search():
    """(the C search function, its lanes), or None where it cannot be built (quantkit.core.native)."""
    source = Path(__file__).with_suffix(".c")
    search = native.function(source, "trellis_search", [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 9)
    if search is None:
        return None
    return search, native.function(source, "trellis_lanes", [], ctypes.c_int64)()


def _search_native(search, lanes, feat, dist, L, kV, start, end):
    """_search's contract, by the C search: the sequences padded to groups of `lanes`. torch's threads go to groups
    side by side where there are enough groups, else to splitting each group's steps (GPTQ's calls bring few)."""
    n, B, F = feat.shape
    M, groups = 1 << (L - kV), -(-B // lanes)
    padded = groups * lanes
    feat = torch.nn.functional.pad(feat, (0, 0, 0, padded - B))
    feat = feat.view(n, groups, lanes, F).permute(1, 0, 3, 2).contiguous()     # [groups, n, F, lanes]
    init = torch.zeros(padded, M)
    if start is not None:
        init[:B].masked_fill_(torch.arange(M)[None] != start[:, None], INF)
    init = init.view(groups, lanes, M).transpose(1, 2).contiguous()           # [groups, M, lanes]
    want = torch.full((padded,), -1, dtype=torch.int32)
    if end is not None:
        want[:B] = end
    want = want.view(groups, lanes)
    states = torch.empty(groups, lanes, n, dtype=torch.int32)
    cost = torch.empty(groups, lanes)

    threads = max(1, torch.get_num_threads())
    side_by_side = min(groups, threads)

    def run(g):
        back, scratch = torch.empty(n, M, lanes, dtype=torch.uint8), torch.empty(2, M, lanes)
        search(n, F, L, kV, threads // side_by_side, *(t.data_ptr() for t in (
            feat[g], dist, init[g], want[g], back, scratch[0], scratch[1], states[g], cost[g])))

    native.side_by_side(run, groups, side_by_side)
    return states.view(padded, n)[:B].to(torch.int64), cost.view(padded)[:B]


def chunk_size(n: int, L: int, kV: int, device: torch.device) -> int:
    """Sequences searched at once on `device` (CHUNK_ELEMENTS, PATH_BYTES: CPU's for any but CUDA)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    return max(1, min(CHUNK_ELEMENTS[kind] >> L, PATH_BYTES[kind] // (4 * n << (L - kV))))


def viterbi(x: torch.Tensor, table: torch.Tensor, L: int, kV: int, weights=None, start=None, end=None):
    """The least-cost state path of each sequence x [B, n, V] through the trellis with state values table [2^L, V].

    weights [B, n, V] (or None: all 1) weigh each weight's squared error; start / end [B] (or None): the overlap
    (L - kV bits) the first state's high bits / the last state's low bits must equal. Returns (states [B, n] int64,
    cost [B] float32: the path's weighted squared error)."""
    x = x.to(torch.float32)
    B, n, V = x.shape
    dist = distortion_matrix(table).to(x.device)
    feat = step_features(x, weights)
    w = torch.ones_like(x) if weights is None else weights.to(x.dtype)
    constant = (w * x * x).sum(dim=(1, 2))
    part = (lambda o, b0, b1: None if o is None else o[b0:b1].to(torch.int64))
    compiled = native_search() if x.device.type == "cpu" else None
    if compiled is not None and (n << (L - kV)) * compiled[1] <= NATIVE_BACK_BYTES:
        states, cost = _search_native(*compiled, feat, dist, L, kV, part(start, 0, B), part(end, 0, B))
        return states, cost + constant
    states = torch.empty(B, n, dtype=torch.int64, device=x.device)
    cost = torch.empty(B, device=x.device)
    step = chunk_size(n, L, kV, x.device)
    for b0 in range(0, B, step):
        b1 = min(b0 + step, B)
        states[b0:b1], cost[b0:b1] = _search(feat[:, b0:b1], dist, L, kV, part(start, b0, b1), part(end, b0, b1))
    return states, cost + constant


def tail_biting(x: torch.Tensor, table: torch.Tensor, L: int, kV: int, weights=None):
    """QTIP's two-search tail-biting approximation (module docstring): (states [B, n], cost [B])."""
    h = x.shape[1] // 2
    roll = (lambda t: None if t is None else torch.roll(t, h, dims=1))  # rolled step h is the original step 0
    rolled, _ = viterbi(roll(x), table, L, kV, roll(weights))
    overlap = rolled[:, h] >> kV
    return viterbi(x, table, L, kV, weights, start=overlap, end=overlap)


def tail_biting_exact(x: torch.Tensor, table: torch.Tensor, L: int, kV: int, weights=None):
    """The exact tail-biting optimum: every overlap tried (2^(L-kV) searches, batched). (states [B, n], cost [B])."""
    B, O = x.shape[0], 1 << (L - kV)
    rep = (lambda t: None if t is None else t.repeat_interleave(O, dim=0))
    overlap = torch.arange(O, device=x.device).repeat(B)
    states, cost = viterbi(rep(x), table, L, kV, rep(weights), start=overlap, end=overlap)
    best = cost.view(B, O).argmin(dim=1)
    pick = torch.arange(B, device=x.device) * O + best
    return states[pick], cost[pick]

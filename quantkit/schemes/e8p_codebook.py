"""E8P: QuIP#'s ball-shaped 2^16-point subset of E8 + ¼ (2 bits per weight), and residual stages for 3 and 4 bits.

The codebook (Tseng et al. 2024, "QuIP#", section 4.1; Cornell-RelaxML/quip-sharp lib/codebook/
latticee8_padded12.py; the code below is written from those facts):

    S = { s ⊙ a : a ∈ ABS, s ∈ {±1}⁸, Σ(s ⊙ a) even }         E8P = (S + ¼) ∪ (S − ¼)

ABS holds 256 patterns of absolute values, all half-integers: the 227 abs patterns of the points of D8 + ½ with
squared norm ≤ 10 (a ∈ {½, 3/2, 5/2}⁸ with Σa² ≤ 10) and 29 of the 56 patterns with five 3/2 and three ½
(squared norm 12; QuIP#'s choice of 29). Each pattern has 128 even-sum sign patterns (flipping one half-integer
coordinate changes the parity of the sum), so |S| = 2^15 and |E8P| = 2^16. S ⊂ D8 + ½ (half-integer points with
even sum), so S + ¼ ⊂ E8 + ¼ and S − ¼ = (S − ½) + ¼ ⊂ D8 + ¼ ⊂ E8 + ¼.

The 16-bit code of a point (this project's layout; QuIP#'s differs):

    bits 0–7    index into ABS (ABS_TABLE below)
    bits 8–14   signs of coordinates 0–6 (1 = negative)
    bit 15      the shift: 0 → +¼, 1 → −¼
    coordinate 7's sign is implied: negative iff (number of negative signs among 0–6 + Σa) is odd,
    which is what keeps Σ(s ⊙ a) even (Σ s⊙a ≡ Σa + #negatives mod 2, since every 2a is odd).

Nearest point (exact): for each shift t, y' = y − t, u = |y'|; with the signs of y' the distance to s ⊙ a is
||u − a||², plus, when the parity is wrong, the cheapest one-sign flip 4 min_i a_i u_i. The 227 patterns are
all permutations of 7 sorted multisets, and for a multiset the best arrangement is the sorted one (it maximises
<u, a> and minimises min a_i u_i at once), so sorting u leaves 7 candidates; the 29 norm-12 patterns are tried
one by one (where they can beat the best of the 7).

Residual stages (QuIP#'s E8P12RVQ3B / E8P12RVQ4B): stage 2 quantizes the stage-1 residual, magnified by a fixed
ratio r, and the point decodes as p1 + p2 / r:
  3 bits   p2 from a 256-point codebook of E8 itself ("E8 1-bit": 0, the 240 roots of norm² 2, and 15 of the 16
           points ±2e_i, all but −2e_7), an 8-bit index: 24 bits per 8 weights;
  4 bits   p2 from E8P again: 32 bits per 8 weights.
The ratio is a setting of the layer (measured on unit Gaussians, see RATIO); both stages are greedy, as in QuIP#.

Codes per column: the 8b-bit word of a point (stage-1 code in bits 0–15, stage-2 index or code in bits 16 and
up) is split over its 8 columns, column j holding bits [b·j, b·j + b): packed as quantkit packs any b-bit
codes (one LSB-first bit stream along the input dim), the 8 columns of a point are exactly its word.
"""
import itertools
from typing import Optional

import torch

# Positions of the three ½ among five 3/2 in the 29 norm-12 patterns (QuIP#'s get_norm12, in its order).
NORM12_HALVES = ((1, 2, 3), (0, 2, 3), (0, 1, 3), (0, 1, 2), (3, 6, 7), (3, 5, 7), (3, 4, 7), (3, 5, 6), (3, 4, 6),
                 (3, 4, 5), (2, 6, 7), (2, 5, 7), (2, 4, 7), (2, 5, 6), (2, 4, 6), (2, 4, 5), (1, 6, 7), (1, 5, 7),
                 (1, 4, 7), (1, 5, 6), (1, 4, 6), (0, 4, 5), (0, 6, 7), (0, 5, 7), (0, 4, 7), (0, 5, 6), (0, 4, 6),
                 (0, 1, 4), (2, 3, 7))


def _abs_patterns() -> list:
    """The 256 patterns as tuples of 2|a| (odd integers): 227 with Σa² ≤ 10 in lexicographic order, then the 29."""
    ball = [t for t in itertools.product((1, 3, 5), repeat=8) if sum(v * v for v in t) <= 40]
    return ball + [tuple(1 if i in h else 3 for i in range(8)) for h in NORM12_HALVES]


def _pack_nibbles(values) -> int:
    """8 values in 0..15 -> one int: value j at bits [4j, 4j + 4)."""
    return sum(int(v) << (4 * j) for j, v in enumerate(values))


# The stored form of ABS: one int per pattern, 2|a_j| at bits [4j, 4j + 4) (what the Triton decode reads).
ABS_TABLE = tuple(_pack_nibbles(t) for t in _abs_patterns())


def _e8_1bit_points() -> list:
    """The 256 points of the 3-bit residual codebook, as tuples of 2v: 0, the 112 integer roots (±1, ±1 at two
    places), the 128 half-integer roots (±½ with an even number of minus signs), ±2e_i except −2e_7."""
    pts = [(0,) * 8]
    for i, j in itertools.combinations(range(8), 2):
        for si, sj in itertools.product((2, -2), repeat=2):
            p = [0] * 8
            p[i], p[j] = si, sj
            pts.append(tuple(p))
    pts += [s for s in itertools.product((1, -1), repeat=8) if s.count(-1) % 2 == 0]
    pts += [tuple(4 * sign if k == i else 0 for k in range(8)) for sign in (1, -1) for i in range(8)][:15]
    return pts


# The stored form of the 3-bit residual codebook: one int per point, 2 v_j + 8 at bits [4j, 4j + 4).
E8_1BIT_TABLE = tuple(_pack_nibbles(v + 8 for v in p) for p in _e8_1bit_points())

# Stage-2 magnification r (point = p1 + p2 / r), measured on 1,500 unit Gaussian blocks of 128 with the searched
# per-group scale (scripts/bench_distortion.py --e8p-ratios): 3 bits best at 2.0–2.04 among 1.6–2.7 (MSE 0.0276),
# 4 bits best at 3.8 among 2.8–4.2 (0.00729, against 0.00759 at QuIP#'s 3.45, which QuIP# pairs with one global
# scale). A per-group ratio would cost another 16 bits per group.
RATIO = {3: 2.04, 4: 3.8}
# Block rms over the per-group scale at which E8P fits a unit Gaussian best (measured; the search looks ±30 %).
NATURAL_SPREAD = {2: 1.03, 3: 1.0, 4: 1.03}
SUPPORTED_BITS = (2, 3, 4)


def unpack_nibbles(table, like: torch.Tensor) -> torch.Tensor:
    """Packed table ints [T] (a sequence or an int32 tensor, read as unsigned) -> their 8 nibbles [T, 8] (int64)
    on like's device."""
    t = torch.as_tensor(table, device=like.device).to(torch.int64) & 0xFFFFFFFF
    return (t[:, None] >> (4 * torch.arange(8, device=like.device))) & 15


class _Tables:
    """Tensors derived from the tables for one device and dtype (cached)."""

    _cache: dict = {}

    @classmethod
    def get(cls, like: torch.Tensor):
        key = (like.device, like.dtype)
        if key not in cls._cache:
            cls._cache[key] = cls(like)
        return cls._cache[key]

    def __init__(self, like):
        dev, dt = like.device, like.dtype
        twice = unpack_nibbles(ABS_TABLE, like)                              # [256, 8] 2|a|
        self.abs = twice.to(dt) / 2                                          # [256, 8] |a|
        # The 7 sorted multisets of the 227 ball patterns (ascending), and the index of each arrangement.
        assert sorted(map(tuple, _MULTISETS)) == sorted({tuple(sorted(t)) for t in _abs_patterns()[:227]})
        self.multisets = torch.tensor(_MULTISETS, dtype=dt, device=dev) / 2  # [7, 8]
        powers = 3 ** torch.arange(8, device=dev)
        self.powers = powers
        lookup = torch.full((3 ** 8,), -1, dtype=torch.int64, device=dev)
        lookup[((twice[:227] - 1) // 2 * powers).sum(-1)] = torch.arange(227, device=dev)
        self.lookup = lookup                                                 # base-3 key of (2a - 1) / 2 -> index
        self.norm12 = self.abs[227:]                                         # [29, 8]
        self.norm12_halves = (self.norm12 == 0.5).to(dt).t().contiguous()    # [8, 29] indicator of T
        self.multiset_odd_f = torch.tensor(_MULTISET_ODD, dtype=dt, device=dev)
        res = unpack_nibbles(E8_1BIT_TABLE, like) - 8
        self.e8_1bit = res.to(dt) / 2                                        # [256, 8]
        self.e8_1bit_norm = (self.e8_1bit ** 2).sum(-1)


# Ball multisets (ascending, as |a|) in the order of the cost formulas of _nearest_s: k = 0..4 entries 3/2 (the
# rest ½), then one 5/2 with k = 0, 1 entries 3/2; Σa = 4 + k and 6 + k, so the parity of Σa is that of k.
_MULTISETS = [[1] * (8 - k) + [3] * k for k in range(5)] + [[1] * (7 - k) + [3] * k + [5] for k in range(2)]
_MULTISET_ODD = [0, 1, 0, 1, 0, 0, 1]


# A sorting network for 8 inputs (19 compare-exchanges): the sorted values, about twice as fast as torch.sort on
# [n, 8] rows when the permutation is not needed (the scale search's error-only passes).
_NETWORK8 = ((0, 2), (1, 3), (4, 6), (5, 7), (0, 4), (1, 5), (2, 6), (3, 7), (0, 1), (2, 3), (4, 5), (6, 7),
             (2, 4), (3, 5), (1, 4), (3, 6), (1, 2), (3, 4), (5, 6))


def _sort8(u: torch.Tensor) -> torch.Tensor:
    """u [n, 8] sorted ascending along the last dim (the same values torch.sort gives)."""
    c = list(u.t().unbind(0))
    for i, j in _NETWORK8:
        c[i], c[j] = torch.minimum(c[i], c[j]), torch.maximum(c[i], c[j])
    return torch.stack(c, dim=-1)


def _nearest_s(y: torch.Tensor, tab: "_Tables", want: str):
    """Nearest point of S (the unshifted set) to each row of y [n, 8]: squared error [n] and, unless want is
    "err", (|a| [n, 8], negative [n, 8] bool, abs index [n] or None unless want is "code") of the point.

    With u = |y| sorted ascending (u1 ≤ … ≤ u8) and C0 = Σ(u − ½)², the ball multisets cost C0 + Σ over their
    3/2 entries of (2 − 2u) (the k largest u) and, for the 5/2 entry, 6 − 4u8; the norm-12 pattern with ½ at T
    costs C0 + 10 − 2Σu + 2 Σ_T u. A wrong parity adds the cheapest sign flip, 4 min_i a_i u_i: 2 u1 for the
    ball (the smallest u holds a ½), and for the norm-12 patterns a per-pattern minimum. The 29 are tried only
    where a lower bound (Σ_T u ≥ u1 + u2 + u3, the flip ≥ 2 u1) leaves one of them a chance."""
    u = y.abs()
    neg = y < 0
    even = (neg.sum(-1) % 2 == 0).to(y.dtype)                                 # [n] 1: even number of negatives
    if want == "err":
        us, perm = _sort8(u), None
    else:
        us, perm = torch.sort(u, dim=-1)
    su = us.sum(-1)
    c0 = (us * us).sum(-1) - su + 2
    cost, wrong, pen = _ball_costs(us, c0, even, tab)
    if want == "err":
        best, which = cost.amin(dim=-1), None
    else:
        best, which = cost.min(dim=-1)
    best, rows, j, flip_at12 = _norm12_improvements(u, us, su, c0, even, pen, best, tab)
    if want == "err":
        return best, None
    a = torch.empty_like(u).scatter_(-1, perm, tab.multisets[which])
    idx = tab.lookup[((a - 0.5).round().long() * tab.powers).sum(-1)] if want == "code" else None
    flip = wrong.gather(-1, which[:, None]) > 0                               # [n, 1]
    flip_at = perm[:, :1]
    if rows is not None and rows.numel():
        a[rows] = tab.norm12[j]
        if idx is not None:
            idx[rows] = 227 + j
        flip[rows, 0] = even[rows] > 0
        flip_at = flip_at.clone()
        flip_at[rows, 0] = flip_at12
    neg.scatter_(-1, flip_at, neg.gather(-1, flip_at) ^ flip)
    return best, (a, neg, idx)


def _ball_costs(us, c0, even, tab):
    """The squared errors [n, 7] of the 7 ball multisets for sorted |y| us [n, 8] (a wrong parity already paid by
    its cheapest sign flip), which of them have the wrong parity [n, 7], and that flip's cost 2 u1 [n, 1]."""
    d = 2 - 2 * us[:, 4:].flip(-1)                                           # 2 − 2u for u8, u7, u6, u5
    a_costs = c0[:, None] + torch.cat([torch.zeros_like(c0[:, None]), d.cumsum(-1)], dim=-1)   # k = 0..4
    b0 = c0 + 6 - 4 * us[:, 7]
    cost = torch.cat([a_costs, b0[:, None], (b0 + d[:, 1])[:, None]], dim=-1)  # [n, 7]
    pen = 2 * us[:, :1]
    odd_k = tab.multiset_odd_f                                                # [7]
    wrong = even[:, None] * odd_k + (1 - even[:, None]) * (1 - odd_k)          # parity of negatives ≠ Σa's
    return cost + wrong * pen, wrong, pen


def _norm12_improvements(u, us, su, c0, even, pen, best, tab):
    """The rows where one of the 29 norm-12 patterns beats the ball: (best errors [n] updated, those rows, their
    pattern, the coordinate whose sign their parity flips); rows is None when no row is even a candidate."""
    c12 = c0 + 10 - 2 * su
    # Lower bound over the 29: Σ_T u ≥ the sum of the three smallest u (the best of all 56 arrangements).
    bound = c12 + 2 * us[:, :3].sum(-1) + even * pen[:, 0]                    # Σa = 9: wrong when even
    cand = (bound < best).nonzero().squeeze(-1)
    if not cand.numel():
        return best, None, None, None
    uc = u[cand]
    prod = tab.norm12[None] * uc[:, None, :]                                  # [c, 29, 8]
    pen_val, pen_at = prod.min(dim=-1)
    c_cost = (c12[cand, None] + 2 * (uc @ tab.norm12_halves)) + even[cand, None] * 4 * pen_val
    c_best, c_which = c_cost.min(dim=-1)
    wi = (c_best < best[cand]).nonzero().squeeze(-1)
    rows, j = cand[wi], c_which[wi]
    best = best.clone()
    best[rows] = c_best[wi]
    return best, rows, j, pen_at[wi, j]


def e8p_nearest(y: torch.Tensor, want: str = "code"):
    """The nearest E8P point to each 8-vector of y [..., 8]: (16-bit code [...] int64, point [..., 8] in y's
    dtype, squared error [...]); the code is None unless want is "code", the point too when want is "err"."""
    shape = y.shape[:-1]
    flat = y.reshape(-1, 8)
    tab = _Tables.get(flat)
    e0, r0 = _nearest_s(flat - 0.25, tab, want)
    e1, r1 = _nearest_s(flat + 0.25, tab, want)
    err = torch.minimum(e0, e1).reshape(shape)
    if want == "err":
        return None, None, err
    second = e1 < e0
    a = torch.where(second[:, None], r1[0], r0[0])
    neg = torch.where(second[:, None], r1[1], r0[1])
    point = (torch.where(neg, -a, a) + (0.25 - 0.5 * second.to(y.dtype))[:, None]).reshape(*shape, 8)
    if want != "code":
        return None, point, err
    idx = torch.where(second, r1[2], r0[2])
    code = idx | (neg[:, :7].long() << torch.arange(8, 15, device=y.device)).sum(-1) | (second.long() << 15)
    return code.reshape(shape), point, err


def e8p_decode(code: torch.Tensor, dtype=torch.float64, table=ABS_TABLE) -> torch.Tensor:
    """The E8P point [..., 8] of 16-bit codes [...] (any integer dtype; bits above 15 are ignored)."""
    code = code.long()
    twice = unpack_nibbles(table, code)[code & 255]                          # [..., 8] 2|a|
    signs = (code[..., None] >> torch.arange(8, 15, device=code.device)) & 1  # [..., 7]
    last = (signs.sum(-1) + twice.sum(-1) // 2) % 2
    signs = torch.cat([signs, last[..., None]], dim=-1)
    shift = 0.25 - 0.5 * ((code >> 15) & 1)
    return (twice * (1 - 2 * signs)).to(dtype) / 2 + shift[..., None].to(dtype)


def e8_1bit_nearest(y: torch.Tensor):
    """(index [...] int64, point [..., 8]) of the nearest of the 256 residual points to y [..., 8]."""
    tab = _Tables.get(y)
    idx = (2 * y @ tab.e8_1bit.t() - tab.e8_1bit_norm).argmax(dim=-1)
    return idx, tab.e8_1bit[idx]


def e8_1bit_error(y: torch.Tensor) -> torch.Tensor:
    """Squared distance [...] from y [..., 8] to the nearest of the 256 residual points, without a search: the
    best of 0 (|y|²), the integer roots (±1 at the two largest |y_i|: |y|² − 2(m1 + m2) + 2), the half-integer
    roots (signs of y, the smallest |y_i| flipped when the number of negatives is odd: |y|² − Σ|y_i| + 2, plus
    2 min|y_i|) and ±2e_i without −2e_7 (|y|² − 4 max(|y_0..6|, y_7) + 4)."""
    u = y.abs()
    top2 = u.topk(2, dim=-1).values
    yy = (y * y).sum(-1)
    odd = ((y < 0).sum(-1) % 2).to(y.dtype)
    half = 2 - u.sum(-1) + 2 * odd * u.min(dim=-1).values
    axis = torch.maximum(u[..., :7].max(dim=-1).values, y[..., 7])
    best = torch.minimum(torch.minimum(2 - 2 * top2.sum(-1), half), (4 - 4 * axis).clamp(max=0))
    return yy + best


def e8_1bit_decode(idx: torch.Tensor, dtype=torch.float64, table=E8_1BIT_TABLE) -> torch.Tensor:
    idx = idx.long()
    return (unpack_nibbles(table, idx)[idx] - 8).to(dtype) / 2


def encode(y: torch.Tensor, bits: int, ratio: Optional[float]):
    """(code word [...] int64 of 8·bits bits, point [..., 8]) of y [..., 8]: E8P, then the residual stage."""
    c1, p1, _ = e8p_nearest(y)
    if bits == 2:
        return c1, p1
    r = (y - p1) * ratio
    if bits == 3:
        c2, p2 = e8_1bit_nearest(r)
    else:
        c2, p2, _ = e8p_nearest(r)
    return c1 | (c2 << 16), p1 + p2 / ratio


def decode(word: torch.Tensor, bits: int, ratio: Optional[float], tables=None) -> torch.Tensor:
    """Points [..., 8] of code words [...] (the inverse of encode), float32 as the kernel computes them: both
    stages are exact in float32, then p1 + p2 / ratio in float32 arithmetic. tables: the kernel's int32 tables
    (E8P.kernel_decode.table: ABS, then for 3 bits the residual points); the built-in ones by default."""
    dtype = torch.float32
    word = word.long()
    abs_table = ABS_TABLE if tables is None else tables[:256]
    p = e8p_decode(word & 0xFFFF, dtype, abs_table)
    if bits == 3:
        p = p + e8_1bit_decode((word >> 16) & 0xFF, dtype, E8_1BIT_TABLE if tables is None else tables[256:]) / ratio
    elif bits == 4:
        p = p + e8p_decode((word >> 16) & 0xFFFF, dtype, abs_table) / ratio
    return p


def split_word(word: torch.Tensor, bits: int) -> torch.Tensor:
    """Code words [...] -> the per-column codes [..., 8]: column j holds bits [bits·j, bits·j + bits)."""
    return (word[..., None] >> (bits * torch.arange(8, device=word.device))) & ((1 << bits) - 1)


def join_word(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-column codes [..., 8] -> code words [...] (int64)."""
    return (codes.long() << (bits * torch.arange(8, device=codes.device))).sum(-1)

"""llama.cpp's k-quant super-blocks, byte for byte (ggml-common.h): codes and parameters <-> GGUF bytes.

Each super-block covers 256 consecutive weights of a row (quantkit.gguf.kquants fits them):
    Q2_K  scales[16] (sc | m << 4), qs[64], d, dmin                   16 sub-blocks of 16, 2-bit codes
    Q3_K  hmask[32], qs[64], scales[12] (6-bit sc + 32), d             16 sub-blocks of 16, 3-bit codes (zero at 4)
    Q4_K  d, dmin, scales[12] (6-bit sc and m), qs[128]                8 sub-blocks of 32, 4-bit codes
    Q5_K  d, dmin, scales[12], qh[32], qs[128]                         8 sub-blocks of 32, 5-bit codes
    Q6_K  ql[128], qh[64], scales[16] (int8 sc), d                    16 sub-blocks of 16, 6-bit codes (zero at 32)
Where the codes' bits go: 2-bit fields (Q2_K, Q3_K's low bits, Q6_K's high bits) put weights 32k + l (k = 0..3) of
each 128 in byte l at bits 2k; 4-bit fields put weights l and l + 32 of each 64 in byte l's low and high nibble
(Q6_K's low nibbles: weights l and l + 64 of each 128); single bits (Q3_K's hmask, Q5_K's qh) put weight 32k + l
in byte l at bit k. The 6-bit scales of Q4_K / Q5_K: bytes 0-3 hold sc 0-3, bytes 4-7 m 0-3, each with the top two
bits of sc 4-7 / m 4-7 in bits 6-7; bytes 8-11 hold the low nibbles of sc 4-7 and m 4-7. Q3_K's: bytes 0-7 hold the
low nibbles of sc j (low) and j + 8 (high), byte 8 + i the top two bits of sc i, i + 4, i + 8, i + 12.

Parameters are per sub-block, as the quantizer keeps them: {"d", "sc"} (and {"dmin", "m"}), d and dmin repeated
over their super-block; sc signed for the symmetric types.
"""
import torch

from quantkit.core.errors import QuantkitError
from quantkit.gguf.kquants import KTYPES, SUPER
from quantkit.gguf.legacy_blocks import fp16_bytes

TYPES = {k.name: k for k in KTYPES.values()}
GGML_TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
OFFSETS = {"Q3_K": 4, "Q6_K": 32}  # the code of zero of the symmetric types


def encode(name: str, codes: torch.Tensor, params: dict) -> torch.Tensor:
    """uint8 [rows, K / 256 * block bytes] from codes [rows, K] and params [rows, K / sub-block]."""
    kind = TYPES[name]
    rows, k = codes.shape
    if k % SUPER:
        raise QuantkitError(f"{name} takes rows of whole super-blocks of {SUPER} weights; this one has {k}")
    nb, per = k // SUPER, SUPER // kind.sub
    q = codes.to(torch.int32).reshape(rows, nb, SUPER)
    if int(q.min()) < 0 or int(q.max()) >= 2 ** _bits(name):
        raise QuantkitError(f"{name} codes must lie in 0..{2 ** _bits(name) - 1}")
    sub = {key: v.reshape(rows, nb, per) for key, v in params.items()}
    d = fp16_bytes(sub["d"][..., 0])
    sc = sub["sc"].round().to(torch.int32)
    if name == "Q2_K":
        scales = (sc | sub["m"].round().to(torch.int32) << 4).to(torch.uint8)
        return _cat(scales, _crumbs(q), d, fp16_bytes(sub["dmin"][..., 0]))
    if name == "Q3_K":
        return _cat(_bit_planes(q >> 2), _crumbs(q & 3), _q3_scales(sc + 32), d)
    if name == "Q6_K":
        return _cat(_nibble_pairs(q & 15, 64), _crumbs(q >> 4), sc.to(torch.int8).view(torch.uint8), d)
    head = [d, fp16_bytes(sub["dmin"][..., 0]), _k4_scales(sc, sub["m"].round().to(torch.int32))]
    if name == "Q5_K":
        head.append(_bit_planes(q >> 4))
    return _cat(*head, _nibble_pairs(q & 15, 32))


def decode(name: str, data: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(codes [rows, K] int32, params {key: float32 [rows, K / sub-block]}) from the bytes encode writes."""
    kind = TYPES[name]
    rows = data.shape[0]
    b = data.reshape(rows, -1, kind.block_bytes).to(torch.int32)
    per = SUPER // kind.sub
    if name == "Q2_K":
        q, params = _from_crumbs(b[..., 16:80]), {"sc": b[..., :16] & 15, "m": b[..., :16] >> 4}
        params.update(d=_half(b, 80), dmin=_half(b, 82))
    elif name == "Q3_K":
        q = _from_crumbs(b[..., 32:96]) | _from_bit_planes(b[..., :32]) << 2
        params = {"sc": _q3_unscale(b[..., 96:108]) - 32, "d": _half(b, 108)}
    elif name == "Q6_K":
        q = _from_nibble_pairs(b[..., :128], 64) | _from_crumbs(b[..., 128:192]) << 4
        params = {"sc": b[..., 192:208].to(torch.uint8).view(torch.int8).to(torch.int32), "d": _half(b, 208)}
    else:
        sc, m = _k4_unscale(b[..., 4:16])
        q = _from_nibble_pairs(b[..., -128:], 32)
        if name == "Q5_K":
            q = q | _from_bit_planes(b[..., 16:48]) << 4
        params = {"d": _half(b, 0), "dmin": _half(b, 2), "sc": sc, "m": m}
    for key in ("d", "dmin"):
        if key in params:
            params[key] = params[key][..., None].expand(rows, -1, per)
    return q.reshape(rows, -1), {k: v.float().reshape(rows, -1) for k, v in params.items()}


def dequantize(name: str, data: torch.Tensor) -> torch.Tensor:
    """float32 [rows, K] as llama.cpp decodes: (d sc) (q - zero) - (dmin m), per sub-block."""
    codes, p = decode(name, data)
    col = torch.arange(codes.shape[1]) // TYPES[name].sub
    w = (p["d"] * p["sc"])[:, col] * (codes - OFFSETS.get(name, 0)).float()
    return w - (p["dmin"] * p["m"])[:, col] if "m" in p else w


def _bits(name: str) -> int:
    return int(name[1])


def _cat(*parts) -> torch.Tensor:
    return torch.cat([p.to(torch.uint8) for p in parts], dim=-1).reshape(parts[0].shape[0], -1)


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[..., at:at + 2].to(torch.uint8).contiguous().view(torch.float16).squeeze(-1)


def _crumbs(q: torch.Tensor) -> torch.Tensor:
    """2-bit values [rows, nb, 256] -> bytes [rows, nb, 64]: weight 128 h + 32 k + l at byte 32 h + l, bits 2k."""
    v = q.reshape(*q.shape[:2], 2, 4, 32) << (2 * torch.arange(4)).reshape(4, 1)
    return v.sum(dim=3).reshape(*q.shape[:2], 64)


def _from_crumbs(b: torch.Tensor) -> torch.Tensor:
    v = b.reshape(*b.shape[:2], 2, 1, 32) >> (2 * torch.arange(4)).reshape(4, 1)
    return (v & 3).reshape(*b.shape[:2], SUPER)


def _bit_planes(bits: torch.Tensor) -> torch.Tensor:
    """1-bit values [rows, nb, 256] -> bytes [rows, nb, 32]: weight 32 k + l at byte l, bit k."""
    v = bits.reshape(*bits.shape[:2], 8, 32) << torch.arange(8).reshape(8, 1)
    return v.sum(dim=2)


def _from_bit_planes(b: torch.Tensor) -> torch.Tensor:
    return ((b.unsqueeze(2) >> torch.arange(8).reshape(8, 1)) & 1).reshape(*b.shape[:2], SUPER)


def _nibble_pairs(q: torch.Tensor, run: int) -> torch.Tensor:
    """4-bit values [rows, nb, 256] -> bytes [rows, nb, 128]: of each 2 run weights, weights l and run + l in byte l
    (low and high nibble). Q4_K / Q5_K: runs of 32; Q6_K's low nibbles: runs of 64."""
    v = q.reshape(*q.shape[:2], -1, 2, run)
    return (v[..., 0, :] | v[..., 1, :] << 4).reshape(*q.shape[:2], 128)


def _from_nibble_pairs(b: torch.Tensor, run: int) -> torch.Tensor:
    v = b.reshape(*b.shape[:2], -1, 1, run)
    return torch.cat([v & 15, v >> 4], dim=3).reshape(*b.shape[:2], SUPER)


def _k4_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: 8 six-bit scales and mins [rows, nb, 8] -> 12 bytes."""
    lo = torch.cat([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6], dim=-1)
    return torch.cat([lo, (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], dim=-1)


def _k4_unscale(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc = torch.cat([b[..., :4] & 63, (b[..., 8:] & 15) | (b[..., :4] >> 6) << 4], dim=-1)
    m = torch.cat([b[..., 4:8] & 63, (b[..., 8:] >> 4) | (b[..., 4:8] >> 6) << 4], dim=-1)
    return sc, m


def _q3_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K: 16 six-bit scales (sc + 32) [rows, nb, 16] -> 12 bytes."""
    low = (s[..., :8] & 15) | (s[..., 8:] & 15) << 4
    high = ((s >> 4) & 3).reshape(*s.shape[:2], 4, 4) << (2 * torch.arange(4)).reshape(4, 1)
    return torch.cat([low, high.sum(dim=2)], dim=-1)


def _q3_unscale(b: torch.Tensor) -> torch.Tensor:
    low = torch.cat([b[..., :8] & 15, b[..., :8] >> 4], dim=-1)
    high = (b[..., 8:12].unsqueeze(2) >> (2 * torch.arange(4)).reshape(4, 1)) & 3
    return low | high.reshape(*b.shape[:2], 16) << 4

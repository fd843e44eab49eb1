"""The randomized Hadamard transform in torch: Pi = blockdiag(H_b / sqrt(b)) . diag(signs) along the last dim.

H_b is the Sylvester Hadamard matrix (H_1 = [1], H_2k = [[H, H], [H, -H]]) scaled by 1/sqrt(b): orthonormal and
its own inverse. b is the largest power of two dividing the width, so any width works (576 = 9 x 64 -> blocks of
64). The fast Walsh-Hadamard transform (log2(b) butterfly stages, O(n log b)), never a dense matrix. This is the
reference every device can run; quantkit.kernels.rotation adds the Triton kernel a quantized layer's forward uses.
"""
import math

import torch


def hadamard_block(n: int) -> int:
    """The Hadamard block size for width n: the largest power of two dividing n (1 for odd n)."""
    if n < 1:
        raise ValueError(f"width must be >= 1, got {n}")
    return n & -n  # two's complement: isolates the lowest set bit


def random_signs(n: int, seed: int) -> torch.Tensor:
    """int8 [n] of +-1, a function of `seed` only (a CPU generator, so every device agrees)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(torch.int8)


def check_block(n, block):
    if block < 1 or block & (block - 1) or n % block:
        raise ValueError(f"block must be a power of two dividing the last dim {n}, got {block}")


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform of each consecutive `block` entries of x's last dim."""
    n = x.shape[-1]
    check_block(n, block)
    y = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32).reshape(-1, n)
    h = 1
    while h < block:  # stage h pairs entries i, i + h within groups of 2h: groups never cross a block
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * (1.0 / math.sqrt(block))).to(x.dtype)


def signs_like(signs, x):
    if signs.shape != (x.shape[-1],):
        raise ValueError(f"signs must be [{x.shape[-1]}], got {tuple(signs.shape)}")
    return signs.to(x.device)


def rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """Pi x along the last dim (torch reference): fwht(x * signs, block)."""
    # signs are +-1, so the product is exact in x's dtype: no rounding before the fp32 transform
    return fwht(x * signs_like(signs, x).to(x.dtype), block)


def unrotate(y: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """Pi^T y along the last dim: fwht(y, block) * signs (H_b is symmetric and its own inverse)."""
    return fwht(y, block) * signs_like(signs, y).to(y.dtype)

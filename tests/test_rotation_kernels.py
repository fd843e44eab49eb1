"""Randomized Hadamard rotation (kernels/rotation.py): torch reference against dense matrices, and the
Triton kernel against the reference.

Without a GPU the Triton kernel runs under TRITON_INTERPRET=1 on CPU tensors; as in test_kernels.py
the interpreter must be on before triton is first imported, so when another module of a full run
imported it first, the CPU cases rerun in a fresh process (test_interpreter_cases_in_fresh_process).

Tolerances: the kernel and the reference do the same butterflies in fp32, so in fp32 they agree
within the summation bound (log2(b) + 1) * 2^-24 * sqrt(b) * max|x| (5e-5 max|x| at b = 4096), and
in fp16, where each rounds its fp32 result once, within 2 ulps of max|y| (4 * 2^-11 * max|y|).
A wrong sign or butterfly moves entries by ~2|x_i|/sqrt(b) (~1e-2 max|x| at b = 4096), a missing
1/sqrt(b) scales everything by sqrt(b) >= 2 (b >= 4 in those cases): both far above the tolerances.
"""
import math
import os
import sys

import pytest
import torch

PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available() and not PREIMPORTED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

from quantkit.kernels.device import triton_available  # noqa: E402
from triton_cases import device_params, rerun_with_interpreter  # noqa: E402
from quantkit.schemes.hadamard import fwht, hadamard_block, random_signs, rotate, unrotate
from quantkit.kernels.rotation import rotate_activations
from quantkit.kernels.triton_rotation import rotate_triton


DEVICES = device_params(None if triton_available() else "not importable", INTERPRET, PREIMPORTED)


def sylvester(b, dtype=torch.float64):
    """Dense H_b / sqrt(b) built by the definition H_2k = [[H, H], [H, -H]] = H_2 (x) H_k."""
    h = torch.ones(1, 1, dtype=dtype)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=dtype)
    while h.shape[0] < b:
        h = torch.kron(h2, h)
    return h / math.sqrt(b)


def dense_rotation(n, block, signs):
    """Pi = blockdiag(H_b) diag(signs) as a dense float64 [n, n] matrix."""
    return torch.block_diag(*[sylvester(block)] * (n // block)) @ torch.diag(signs.double())


def test_hadamard_block():
    assert [hadamard_block(n) for n in (576, 172, 4096, 1536, 7, 1)] == [64, 4, 4096, 512, 1, 1]
    for bad in (0, -4):
        with pytest.raises(ValueError):
            hadamard_block(bad)


def test_random_signs():
    a, b, c = random_signs(4096, 0), random_signs(4096, 0), random_signs(4096, 1)
    assert a.dtype == torch.int8 and a.shape == (4096,)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert set(a.tolist()) == {-1, 1} and abs(a.float().mean().item()) < 0.1


@pytest.mark.parametrize("b", [1, 2, 4, 64, 256])
def test_fwht_is_sylvester_hadamard(b):
    x = torch.randn(5, b, dtype=torch.float64, generator=torch.Generator().manual_seed(b))
    ref = x @ sylvester(b).T
    assert torch.allclose(fwht(x, b), ref, rtol=0, atol=1e-12)
    y32 = fwht(x.float(), b)
    assert y32.dtype == torch.float32 and torch.allclose(y32.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("n,block", [(576, 64), (172, 4), (64, 8)])
def test_rotate_is_block_diagonal(n, block):
    signs = random_signs(n, n)
    x = torch.randn(2, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q = dense_rotation(n, block, signs)
    assert torch.allclose(rotate(x, signs, block), x @ q.T, rtol=0, atol=1e-12)
    assert torch.allclose(unrotate(x, signs, block), x @ q, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [576, 172, 256])
def test_orthogonality_and_inverse(n):
    block, signs = hadamard_block(n), random_signs(n, 7)
    eye = torch.eye(n, dtype=torch.float64)
    q = rotate(eye, signs, block).T  # column j = Pi e_j
    assert torch.allclose(q, dense_rotation(n, block, signs), rtol=0, atol=1e-12)
    assert torch.allclose(q @ q.T, eye, rtol=0, atol=1e-12)
    x = torch.randn(4, n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(unrotate(rotate(x, signs, block), signs, block), x, rtol=0, atol=1e-12)
    x32 = x.float()
    back = unrotate(rotate(x32, signs, block), signs, block)
    assert back.dtype == torch.float32 and torch.allclose(back, x32, rtol=0, atol=1e-5)


def test_bad_arguments():
    x = torch.randn(2, 12)
    with pytest.raises(ValueError):
        fwht(x, 8)  # does not divide 12
    with pytest.raises(ValueError):
        fwht(x, 3)  # not a power of two
    with pytest.raises(ValueError):
        rotate(x, random_signs(8, 0), 4)
    with pytest.raises(ValueError):
        rotate_activations(x, random_signs(12, 0), 4, backend="cuda")


def test_rotate_activations_torch_paths():
    x, signs = torch.randn(3, 576), random_signs(576, 3)
    ref = rotate(x, signs, 64)
    assert torch.equal(rotate_activations(x, signs, 64), ref)  # auto on CPU: torch
    assert torch.equal(rotate_activations(x, signs, 64, backend="torch"), ref)
    if not INTERPRET:
        with pytest.raises(ValueError):
            rotate_activations(x, signs, 64, backend="triton")


def _check_triton(x, signs, block):
    """rotate_triton(x) against the reference computed in fp32, then rounded to x's dtype."""
    y = rotate_triton(x, signs, block)
    ref = rotate(x.float(), signs, block)
    assert y.dtype == x.dtype and y.shape == x.shape and y.device == x.device
    if x.dtype == torch.float32:  # log2(b) + 1 roundings of partial sums bounded by sqrt(b) max|x|
        tol = (math.log2(block) + 1) * 2.0**-24 * math.sqrt(block) * x.abs().max().item()
    else:  # each side rounds once to fp16: <= 1 ulp apart, i.e. 2^-10 |y|; 2 ulps allowed
        tol = 4 * 2.0**-11 * ref.abs().max().item()
    err = (y.float() - ref.to(x.dtype).float()).abs().max().item()
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [64, 172, 576, 1024])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_triton_matches_reference(device, dtype, n, m):
    g = torch.Generator().manual_seed(m * 10000 + n)
    x = (torch.randn(m, n, generator=g) * 3).to(dtype).to(device)
    _check_triton(x, random_signs(n, n + 1), hadamard_block(n))


@pytest.mark.parametrize("device", DEVICES)
def test_triton_3d_and_large_block(device):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 576, generator=g).half().to(device)
    _check_triton(x, random_signs(576, 2), 64)
    x = torch.randn(3, 4096, generator=g).to(device)  # one 4096 block: BLOCK_M capped at 2
    _check_triton(x, random_signs(4096, 4), 4096)
    x = torch.randn(70, 128, generator=g).to(device)  # 70 rows: two row tiles, the last one masked
    _check_triton(x, random_signs(128, 5), 128)
    signs = random_signs(576, 2)
    y = rotate_activations(x.new_ones(4, 576), signs, 64, backend="triton")
    assert torch.allclose(y.cpu(), rotate(torch.ones(4, 576), signs, 64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_the_triton_rotation_compiles_in_one_graph(device):
    """The Triton call is the custom op torch.ops.quantkit.hadamard_rotate: no graph break at its launch code."""
    signs = random_signs(576, 3).to(device)
    rotated = torch.compile(lambda x: rotate_activations(x, signs, 64, backend="triton") * 2, backend="aot_eager",
                            fullgraph=True)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(3)).half().to(device)
    assert torch.equal(rotated(x), rotate_activations(x, signs, 64, backend="triton") * 2)


@pytest.mark.skipif(not PREIMPORTED or torch.cuda.is_available(),
                    reason="the interpreter cases already ran in this process (or a GPU runs the real ones)")
def test_interpreter_cases_in_fresh_process():
    """Triton was imported before this module could turn the interpreter on: rerun it in a new one."""
    rerun_with_interpreter(__file__, timeout=600)

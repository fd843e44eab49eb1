"""llama.cpp's legacy block types (issue 39): quantkit's bytes decode through the gguf package's own dequantize
(llama.cpp's layout as its Python reader implements it), and a symmetric 32-group grid is a Q4_0 / Q8_0 block."""
import numpy as np
import pytest
import torch

from quantkit.core.errors import QuantkitError
from quantkit.gguf import legacy_blocks as blocks
from quantkit.schemes.grid import Grid

gguf = pytest.importorskip("gguf")


def reference_dequantize(kind, data: torch.Tensor) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType(kind.ggml_type)
    assert gguf.GGML_QUANT_SIZES[qtype] == (blocks.BLOCK, kind.block_bytes)
    return torch.from_numpy(gguf.quants.dequantize(data.numpy(), qtype).astype(np.float32))


@pytest.mark.parametrize("name", sorted(blocks.TYPES))
def test_every_legacy_type_decodes_bit_for_bit_through_gguf(name):
    kind = blocks.TYPES[name]
    gen = torch.Generator().manual_seed(kind.ggml_type)
    rows, k = 3, 4 * blocks.BLOCK
    codes = torch.randint(0, 2**kind.bits, (rows, k), generator=gen)
    codes[0, :blocks.BLOCK] = torch.arange(blocks.BLOCK) % 2**kind.bits  # every code position and value
    d = (torch.rand(rows, k // blocks.BLOCK, generator=gen) * 0.1).half()
    m = -(torch.rand(rows, k // blocks.BLOCK, generator=gen)).half() if kind.has_min else None
    data = blocks.encode(kind, codes, d, m)
    assert data.dtype == torch.uint8 and data.shape == (rows, k // blocks.BLOCK * kind.block_bytes)
    back, d_back, m_back = blocks.decode(kind, data)
    assert torch.equal(back, codes.int()) and torch.equal(d_back, d)
    assert (m_back is None and m is None) or torch.equal(m_back, m)
    want = (codes.reshape(rows, -1, 32) - kind.offset).float() * d.float().unsqueeze(-1)
    if m is not None:
        want = want + m.float().unsqueeze(-1)
    assert torch.equal(blocks.dequantize(kind, data), want.reshape(rows, k))
    assert torch.equal(reference_dequantize(kind, data), want.reshape(rows, k))


@pytest.mark.parametrize("bits, name", [(4, "Q4_0"), (8, "Q8_0")])
def test_a_symmetric_grid_of_32_is_a_legacy_block_exactly(bits, name):
    """quantkit's symmetric grid, w = scale (q - 2^(bits-1)) with an fp16 scale per 32 weights: what its codes and
    scales decode to is what llama.cpp decodes from the block they make."""
    grid, kind = Grid(bits, sym=True), blocks.TYPES[name]
    w = torch.randn(4, 96, generator=torch.Generator().manual_seed(bits))
    groups = w.reshape(-1, 32)
    params = grid.fit(groups)
    codes, decoded = grid.round(groups, params)
    data = blocks.encode(kind, codes.reshape(4, 96).int(), params["scale"].reshape(4, 3))
    assert torch.equal(reference_dequantize(kind, data), decoded.reshape(4, 96))


def test_bad_input_is_named():
    with pytest.raises(QuantkitError, match="whole blocks of 32"):
        blocks.encode(blocks.TYPES["Q4_0"], torch.zeros(1, 40, dtype=torch.int32), torch.ones(1, 1))
    with pytest.raises(QuantkitError, match="0..15"):
        blocks.encode(blocks.TYPES["Q4_0"], torch.full((1, 32), 16), torch.ones(1, 1))
    with pytest.raises(QuantkitError, match="minimum"):
        blocks.encode(blocks.TYPES["Q4_1"], torch.zeros(1, 32, dtype=torch.int32), torch.ones(1, 1))

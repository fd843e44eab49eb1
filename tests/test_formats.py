"""Bit packing and the GPTQ checkpoint layout, byte for byte."""
import pytest
import torch

from quantkit.core import bitpack
from quantkit.checkpoint import gptq, validate
from quantkit.schemes.grid import Grid
from quantkit.algorithms.rtn import rtn
from tiny_models import dequantize_gptq


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 31, 32, 33, 96, 172, 576])
def test_pack_unpack_round_trip(bits, k):
    g = torch.Generator().manual_seed(k * bits)
    codes = torch.randint(0, 2**bits, (k, 7), generator=g)
    words = bitpack.pack(codes, bits, dim=0)
    assert words.dtype == torch.int32
    assert words.shape == (bitpack.packed_len(k, bits), 7)
    assert torch.equal(bitpack.unpack(words, bits, k, dim=0), codes.to(torch.int32))
    assert torch.equal(bitpack.unpack(bitpack.pack(codes.t(), bits, dim=1), bits, k, dim=1), codes.t().to(torch.int32))


def test_packed_lengths_match_gptq_when_aligned():
    assert bitpack.packed_len(4096, 4) == 4096 * 4 // 32
    assert bitpack.packed_len(4096, 3) == 4096 * 3 // 32
    assert bitpack.packed_len(4096, 2) == 4096 * 2 // 32
    assert bitpack.packed_len(4096, 8) == 4096 * 8 // 32
    assert bitpack.packed_len(172, 4) == 22  # padded to 176 inputs


def test_unaligned_3bit_uses_the_readers_word_count():
    # GPTQModel (nn_modules/qlinear/__init__.py) and transformers/optimum allocate ceil(K * bits / 32) words,
    # not whole 32-code units: 172 * 3 = 516 bits -> 17 words (a 192-code unit would give 18)
    assert bitpack.packed_len(172, 3) == 17
    assert bitpack.packed_len(576, 3) == 54
    assert bitpack.packed_len(100, 5) == 16   # 500 bits
    assert bitpack.packed_len(33, 3) == 4


def test_golden_unaligned_3bit_words():
    # 33 codes of value 7 (0b111): 99 one-bits -> three all-ones words (int32 -1) and a fourth with its
    # 3 low bits set; the stream stops there (a padded unit would add two zero words)
    words = bitpack.pack(torch.full((33, 1), 7), 3)
    assert words[:, 0].tolist() == [-1, -1, -1, 0x7]
    assert torch.equal(bitpack.unpack(words, 3, 33), torch.full((33, 1), 7, dtype=torch.int32))
    # codes 0..9 then 5 at index 32: code 32 sits at bits 96..98, the low bits of word 3
    codes = torch.zeros(33, 1, dtype=torch.long)
    codes[32] = 5
    assert (bitpack.pack(codes, 3)[:, 0].long() & 0xFFFFFFFF).tolist() == [0, 0, 0, 0x5]


def test_golden_words():
    # input j of a word sits at bit offset bits*j, least significant first
    assert bitpack.pack(torch.arange(8).view(8, 1), 4)[0, 0].item() == 0x76543210
    assert bitpack.pack(torch.tensor([[1], [2], [3], [4]]), 8)[0, 0].item() == 0x04030201
    # 3-bit: value 10 spills: bits 30..32 -> low 2 bits in word 0, high bit in word 1
    codes = torch.zeros(32, 1, dtype=torch.long)
    codes[10] = 0b111
    words = (bitpack.pack(codes, 3)[:, 0].long() & 0xFFFFFFFF)
    assert words.tolist() == [0xC0000000, 0x1, 0x0]
    # all-ones 2-bit word is -1 as int32
    assert bitpack.pack(torch.full((16, 1), 3), 2)[0, 0].item() == -1


def test_v1_sym_qzeros_are_0x77777777():
    w = torch.randn(16, 64)
    res = rtn(w, Grid(4, sym=True), 32)
    t = gptq.to_tensors(res, "gptq")
    assert t["qzeros"].shape == (2, 2)
    assert ((t["qzeros"] & 0xFFFFFFFF) == 0x77777777).all()
    t2 = gptq.to_tensors(res, "gptq_v2")
    assert ((t2["qzeros"] & 0xFFFFFFFF) == 0x88888888).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_layout_dequantizes_to_method_weights(bits, sym, fmt):
    w = torch.randn(40, 72)  # 72 % 32 != 0: last group shorter; 40 not a multiple of 8 outputs
    res = rtn(w, Grid(bits, sym), 32, bias=torch.randn(40))
    t = gptq.to_tensors(res, fmt)
    assert t["qweight"].shape == (bitpack.packed_len(72, bits), 40)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (3, 40)
    assert t["g_idx"].tolist() == [i // 32 for i in range(72)]
    assert torch.equal(dequantize_gptq(t, bits, 72, fmt), res.dequantize())


def test_asym_zero_never_wraps_in_v1():
    w = torch.rand(8, 32) + 0.5  # all positive: min/max grid would want zero = 0
    res = rtn(w, Grid(4, sym=False), 32)
    assert res.params["zero"].min() >= 1
    t = gptq.to_tensors(res, "gptq")
    assert torch.equal(dequantize_gptq(t, 4, 32, "gptq"), res.dequantize())


def test_quantization_config_dynamic_round_trip():
    a = rtn(torch.randn(8, 32), Grid(4), 32)
    b = rtn(torch.randn(8, 32), Grid(8), 32)
    qc = gptq.quantization_config(4, 32, True, False, "gptq", {"m.a": a, "m.b": b}, ["m.a", "m.b", "m.c"])
    assert qc["dynamic"] == {"+:^m\\.b$": {"bits": 8, "group_size": 32, "sym": True}, "-:^m\\.c$": {}}
    assert validate.module_settings(qc, "m.a") == (4, 32, True)
    assert validate.module_settings(qc, "m.b") == (8, 32, True)
    for key in ("bits", "group_size", "sym", "desc_act", "static_groups", "checkpoint_format"):
        assert key in qc

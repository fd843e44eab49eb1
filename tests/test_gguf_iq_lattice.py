"""llama.cpp's E8-lattice types IQ2_XXS and IQ3_XXS (issue 39): the point lists, the exact nearest-point search,
the bytes against the gguf package's own dequantize, and --gguf-type IQ2_XXS / IQ3_XXS end to end."""
import itertools

import numpy as np
import pytest
import torch
from tiny_models import make_model_folder
from transformers import AutoModelForCausalLM

from quantkit import api
from quantkit.algorithms.rtn import rtn
from quantkit.core.errors import QuantkitError
from quantkit.gguf.iq_lattice import nearest_points, tables
from quantkit.gguf.mix import layer_types
from quantkit.gguf.types import TYPES
from quantkit.run.config import QuantConfig
from quantkit.schemes.base import fit_all, quantizer_for

gguf = pytest.importorskip("gguf")
KINDS = {"IQ2_XXS": ("iq2xxs", 2), "IQ3_XXS": ("iq3xxs", 3)}


def reference_dequantize(kind: str, data: torch.Tensor) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[kind]
    assert gguf.GGML_QUANT_SIZES[qtype] == (256, TYPES[kind].block_bytes)
    return torch.from_numpy(gguf.quants.dequantize(data.numpy(), qtype).astype(np.float32))


def random_codes(kind: str, rows: int, k: int, gen) -> torch.Tensor:
    """Codes of random points of the list with random signs of even parity."""
    _, points, levels = tables(kind)
    index = torch.randint(0, 256, (rows * k // levels.shape[1],), generator=gen)
    negative = torch.randint(0, 2, (rows * k // 8, 8), generator=gen)
    negative[:, 7] = negative[:, :7].sum(dim=-1) % 2
    bits = 2 if kind == "IQ2_XXS" else 3
    return (levels[index].reshape(rows, k) | negative.reshape(rows, k) << bits)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_random_codes_decode_bit_for_bit_through_gguf(kind):
    """Every point of the list, every sign pattern and scale: quantkit's bytes decode through gguf-py's dequantize
    as the quantizer decodes them, and back to the same codes and parameters."""
    name, bits = KINDS[kind]
    quantizer = quantizer_for(name, bits, True, 32)
    gen = torch.Generator().manual_seed(bits)
    rows, k = 4, 2048
    codes = random_codes(kind, rows, k, gen)
    params = {"d": (torch.rand(rows, k // 256, generator=gen) * 0.01).half().float().repeat_interleave(8, dim=1),
              "sc": torch.randint(0, 16, (rows, k // 32), generator=gen).float()}
    data = TYPES[kind].encode(codes, params)
    assert data.shape == (rows, k // 256 * TYPES[kind].block_bytes)
    back, back_params = TYPES[kind].decode(data)
    assert torch.equal(back.long(), codes) and all(torch.equal(back_params[key], params[key]) for key in params)
    want = quantizer.dequantize(codes, {key: v[:, torch.arange(k) // 32] for key, v in params.items()})
    assert torch.equal(reference_dequantize(kind, data), want)
    assert torch.equal(TYPES[kind].dequantize(data), want)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_lists_are_llama_cpps(kind):
    cls = getattr(gguf.quants, kind)
    cls.init_grid()
    _, points, _ = tables(kind)
    assert np.array_equal(points.numpy(), cls.grid.reshape(cls.grid_shape))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_search_finds_the_nearest_signed_point(kind):
    """Against every even sign pattern with each part's best point under it: the same weighted error, never more."""
    gen = torch.Generator().manual_seed(5)
    x, h = torch.randn(40, 8, generator=gen) * 20, torch.rand(40, 8, generator=gen)
    _, points, _ = tables(kind)
    dims = points.shape[1]
    index, negative = nearest_points(x, kind, h)
    assert not (negative.sum(dim=-1) % 2).any()
    found = (h * (x - points[index].reshape(40, 8) * (1 - 2 * negative.float())).square()).sum(dim=-1)
    signs = torch.tensor([s for s in itertools.product((1.0, -1.0), repeat=8) if s.count(-1.0) % 2 == 0])
    for i in range(40):
        target = (x[i] * signs).view(-1, 8 // dims, 1, dims)            # [128 patterns, parts, 1, dims]
        per_part = (h[i].view(8 // dims, 1, dims) * (target - points).square()).sum(dim=-1).amin(dim=-1)
        assert float(found[i]) == pytest.approx(float(per_part.sum(dim=-1).min()), rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fits_round_closer_than_the_peak_step_and_refuse_bad_codes(kind):
    name, bits = KINDS[kind]
    quantizer = quantizer_for(name, bits, True, 32)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(32, 512, generator=gen)
    res = rtn(w, quantizer, 32)
    assert torch.equal(reference_dequantize(kind, TYPES[kind].encode(res.codes, res.params)), res.dequantize())
    assert res.bits_per_weight() == TYPES[kind].block_bytes * 8 / 256
    relative = float((res.dequantize() - w).square().mean() / w.square().mean())
    assert relative < {"IQ2_XXS": 0.13, "IQ3_XXS": 0.036}[kind]  # RTN weighs by w^2, as llama.cpp without imatrix
    # under a uniform importance the search fits 12-15 % closer than the sub-block's largest weight put on the
    # largest magnitude, with the same scale coding
    searched = fit_all(quantizer, w, 32, torch.ones(512))
    top = {"IQ2_XXS": 43, "IQ3_XXS": 62}[kind]
    peak = w.abs().view(32, 16, 32).amax(dim=-1) / top
    unit = quantizer.unit
    d = (peak.view(32, 2, 8).amax(dim=-1) / (31 * unit)).half().float().repeat_interleave(8, dim=1)
    plain = {"d": d, "sc": ((peak / (unit * d) - 1) / 2).round().clamp(0, 15)}
    error = [float((torch.cat([quantizer.round(w[:, c:c + 32], {k: v[:, c // 32] for k, v in p.items()})[1]
                               for c in range(0, 512, 32)], dim=1) - w).square().mean()) for p in (searched, plain)]
    assert error[0] < 0.9 * error[1]
    odd = res.codes.clone()
    odd[0, 0] ^= 1 << bits  # one sign turned: the count of minus signs in that 8 is odd
    with pytest.raises(QuantkitError, match="even number of minus signs"):
        TYPES[kind].encode(odd, res.params)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_rounding_weighs_columns_by_their_importance(kind):
    """Columns of very unequal importance (as SmolLM2's last ffn_down has): the weighted search rounds the important
    ones closer, at a lower weighted error than the plain search under the same scales."""
    name, bits = KINDS[kind]
    quantizer = quantizer_for(name, bits, True, 32)
    gen = torch.Generator().manual_seed(7)
    w, importance = torch.randn(16, 256, generator=gen), torch.rand(256, generator=gen) ** 6
    params = fit_all(quantizer, w, 32, importance)
    error = [0.0, 0.0]
    for c in range(0, 256, 32):
        p, part = {k: v[:, c // 32] for k, v in params.items()}, slice(c, c + 32)
        for i, extra in enumerate(({"importance": importance[part]}, {})):
            wq = quantizer.round(w[:, part], p, **extra)[1]
            error[i] += float(((wq - w[:, part]).square() * importance[part]).sum())
    assert error[0] < 0.8 * error[1]


def test_file_type_mix_on_whole_super_blocks():
    shapes = {"model.layers.0.self_attn.v_proj": (512, 128), "model.layers.0.self_attn.q_proj": (512, 512),
              **{f"model.layers.{i}.mlp.down_proj": (1024, 512) for i in range(16)}, "lm_head": (512, 1000)}
    types = layer_types("IQ2_XXS", shapes, {"num_attention_heads": 8, "num_key_value_heads": 2}, calibrated=True)
    assert types["model.layers.0.self_attn.v_proj"] == "Q4_K"  # n_gqa >= 4
    assert types["model.layers.0.self_attn.q_proj"] == "IQ2_XXS" and types["lm_head"] == "Q5_K"
    assert [types[f"model.layers.{i}.mlp.down_proj"] for i in (0, 1, 2)] == ["Q2_K", "Q2_K", "IQ2_XXS"]
    with pytest.raises(QuantkitError, match="gives model.layers.0.self_attn.q_proj type IQ2_S"):
        layer_types("IQ3_XXS", shapes, {"num_attention_heads": 8, "num_key_value_heads": 8}, calibrated=True)


def test_gguf_type_iq2_xxs_with_gptq_reads_back_in_transformers(tmp_path):
    torch.manual_seed(0)
    src = make_model_folder("llama-256", tmp_path, dtype=torch.float16)
    ids = torch.randint(0, 512, (4, 64))
    out = tmp_path / "iq2"
    api.quantize(str(src), out, QuantConfig(method="gptq", gguf_type="IQ2_XXS"), calibration_ids=ids)
    reader = gguf.GGUFReader(out / "model.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert reader.fields["general.file_type"].contents() == 19  # LLAMA_FTYPE_MOSTLY_IQ2_XXS
    assert types["blk.1.attn_q.weight"] == types["blk.1.ffn_up.weight"] == "IQ2_XXS"
    assert types["blk.0.ffn_down.weight"] == "IQ4_NL"  # 288 inputs: IQ2_XXS's fallback
    ours = api.load_quantized(out, device="cpu", dtype=torch.float32)  # as theirs
    theirs = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32)
    x = ids[:1, :24]
    torch.testing.assert_close(ours(x).logits, theirs(x).logits, rtol=0, atol=1e-5)

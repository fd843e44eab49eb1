"""llama.cpp's k-quants and IQ types (issue 39): Q2_K .. Q6_K super-blocks and IQ4_NL / IQ4_XS byte for byte
against the gguf package's own dequantize, the quantizers inside RTN and GPTQ, and --gguf-type's per-tensor mix as
llama-quantize makes it."""
from collections import Counter

import numpy as np
import pytest
import torch
from tiny_models import make_model_folder
from transformers import AutoModelForCausalLM

from quantkit import api
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.rtn import rtn
from quantkit.core.errors import QuantkitError
from quantkit.gguf import kquants_blocks as gguf_kquants
from quantkit.gguf.codec import GGUFCodec
from quantkit.gguf.mix import layer_types
from quantkit.run.config import QuantConfig
from quantkit.schemes.base import make_quantizer, quantizer_for

gguf = pytest.importorskip("gguf")
BITS = {"Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}


def reference_dequantize(name, data: torch.Tensor, block=256) -> torch.Tensor:
    from quantkit.gguf.types import TYPES

    qtype = gguf.GGMLQuantizationType[name]
    assert gguf.GGML_QUANT_SIZES[qtype] == (block, TYPES[name].block_bytes)
    return torch.from_numpy(gguf.quants.dequantize(data.numpy(), qtype).astype(np.float32))


def random_params(name, rows, k, gen):
    kind = gguf_kquants.TYPES[name]
    groups = k // kind.sub
    d = (torch.rand(rows, k // 256, generator=gen) * 0.01).half().float().repeat_interleave(256 // kind.sub, dim=1)
    if kind.has_min:
        top = 2**kind.scale_bits
        return {"d": d, "sc": torch.randint(0, top, (rows, groups), generator=gen).float(), "dmin": d.flip(0),
                "m": torch.randint(0, top, (rows, groups), generator=gen).float()}
    half = 2 ** (kind.scale_bits - 1)
    return {"d": d, "sc": torch.randint(-half, half, (rows, groups), generator=gen).float()}


@pytest.mark.parametrize("name", sorted(BITS))
def test_every_k_type_decodes_bit_for_bit_through_gguf(name):
    """Random codes and scales over their whole ranges (every code position of a super-block): quantkit's bytes
    decode to the quantizer's own dequantize through gguf-py's, and decode back to the same codes and params."""
    gen = torch.Generator().manual_seed(BITS[name])
    rows, k = 3, 512
    codes = torch.randint(0, 2 ** BITS[name], (rows, k), generator=gen)
    params = random_params(name, rows, k, gen)
    data = gguf_kquants.encode(name, codes, params)
    assert data.dtype == torch.uint8 and data.shape == (rows, 2 * gguf_kquants.TYPES[name].block_bytes)
    back, back_params = gguf_kquants.decode(name, data)
    assert torch.equal(back, codes.int()) and all(torch.equal(back_params[key], params[key]) for key in params)
    quantizer = make_quantizer("kquant", bits=BITS[name])
    col = torch.arange(k) // quantizer.kind.sub
    want = quantizer.dequantize(codes, {key: v[:, col] for key, v in params.items()})
    assert torch.equal(reference_dequantize(name, data), want)
    assert torch.equal(gguf_kquants.dequantize(name, data), want)


@pytest.mark.parametrize("name", sorted(BITS))
def test_rtn_fits_are_what_llama_cpp_decodes(name):
    """A fitted layer's codes and parameters make blocks that llama.cpp decodes to exactly the weights the method
    computed with; more bits, less error."""
    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(0))
    quantizer = make_quantizer("kquant", bits=BITS[name])
    res = rtn(w, quantizer, quantizer.kind.sub)
    assert torch.equal(reference_dequantize(name, gguf_kquants.encode(name, res.codes, res.params)), res.dequantize())
    assert res.bits_per_weight() == gguf_kquants.TYPES[name].block_bytes * 8 / 256
    relative = float((res.dequantize() - w).square().mean() / w.square().mean())
    assert relative < {"Q2_K": 0.1, "Q3_K": 0.03, "Q4_K": 0.007, "Q5_K": 0.0017, "Q6_K": 0.0004}[name]


def test_gptq_feedback_beats_rounding_to_nearest_on_correlated_inputs():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 256, generator=gen)
    x = torch.randn(1024, 256, generator=gen) @ (torch.eye(256) + 0.3 * torch.randn(256, 256, generator=gen))
    for name, bits, size in [("kquant", 2, 16), ("kquant", 4, 32), ("kquant", 6, 16), ("iq4xs", 4, 32),
                             ("iq2xxs", 2, 32), ("iq3xxs", 3, 32)]:
        quantizer = quantizer_for(name, bits, True, size)
        g = GPTQ(w)
        g.add_batch(x)
        ours = g.quantize(quantizer, size, act_order=True)
        near = rtn(w, quantizer, size)
        err = [float((x @ (r.dequantize() - w).t()).square().mean()) for r in (ours, near)]
        assert err[0] < 0.8 * err[1], (name, bits, err)
        data = GGUFCodec.layer_tensors(ours, None, None)["weight"]
        assert torch.equal(reference_dequantize(quantizer.ggml_type, data), ours.dequantize())


def test_a_layer_comes_back_from_its_blocks_exactly():
    """What resume reads back from a part: the codes and parameters the layer was rounded with."""
    w = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    for name, bits, sym, size in [("kquant", 3, None, 16), ("kquant", 5, None, 32), ("ggml", 4, True, 32),
                                  ("ggml", 5, False, 32), ("int", 4, True, 32), ("iq4nl", 4, True, 32),
                                  ("iq4xs", 4, True, 32), ("iq2xxs", 2, True, 32), ("iq3xxs", 3, True, 32)]:
        res = rtn(w, quantizer_for(name, bits, sym, size), size)
        tensors = {f"x.{k}": v for k, v in GGUFCodec.layer_tensors(res, None, None).items()}
        settings = {"quantizer": name, **res.quantizer.settings(), "group_size": size}
        back = GGUFCodec.layer_result(tensors, "x", settings, "gguf")
        assert torch.equal(back.codes, res.codes) and torch.equal(back.dequantize(), res.dequantize()), name


def test_ggml_legacy_fits_round_better_than_the_grid_and_the_range():
    """A block whose largest weight is positive: llama.cpp's d = max / -8 (negative) steps max/8 where the grid's
    positive scale steps max/7.5, and its weighted search does better still; the ggml quantizer keeps the best."""
    w = torch.linspace(-0.5, 1.0, 32)[None]
    quantizer = make_quantizer("ggml", bits=4, sym=True)
    d = quantizer.fit(w)["d"]
    _, wq = quantizer.round(w, {"d": d})
    grid = make_quantizer("int", bits=4, sym=True)
    _, grid_wq = grid.round(w, grid.fit(w))
    _, plain_wq = quantizer.round(w, {"d": torch.tensor([-1.0 / 8])})
    assert float(d) < 0 and (wq - w).square().sum() <= (plain_wq - w).square().sum() < (grid_wq - w).square().sum()
    # with a minimum (Q4_1): the weighted search against the range fit, on Gaussian blocks with skewed importance
    gen = torch.Generator().manual_seed(3)
    w, importance = torch.randn(64, 32, generator=gen), torch.rand(32, generator=gen) ** 4
    asym = make_quantizer("ggml", bits=4, sym=False)
    span = w.amax(dim=-1) - w.amin(dim=-1)
    ranged = {"d": (span / 15).half().float(), "m": w.amin(dim=-1).half().float()}
    error = [float(((asym.round(w, p)[1] - w).square() * importance).sum())
             for p in (asym.fit(w, importance), ranged)]
    assert error[0] < 0.8 * error[1]


def smollm2_shapes(layers=30, hidden=576, inter=1536, kv=192):
    shapes = {}
    for i in range(layers):
        for leaf, shape in {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, kv),
                            "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (hidden, hidden),
                            "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
                            "mlp.down_proj": (inter, hidden)}.items():
            shapes[f"model.layers.{i}.{leaf}"] = shape
    return shapes


SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3}


@pytest.mark.parametrize("file_type, calibrated, counts", [
    # what llama-quantize wrote for SmolLM2-135M (576-wide rows fall back; ffn_down's 1536 are whole super-blocks)
    ("Q4_K_M", False, {"Q5_0": 166, "Q4_K": 16, "Q8_0": 14, "Q6_K": 14}),
    ("Q3_K_M", False, {"Q4_0": 120, "Q5_0": 58, "Q4_K": 29, "Q5_1": 2, "Q5_K": 1}),
    ("Q2_K", False, {"Q4_0": 180, "Q3_K": 30}),
    ("IQ4_XS", False, {"IQ4_NL": 180, "IQ4_XS": 27, "Q5_K": 3}),  # without an imatrix the first ffn_down get Q5_K
    ("IQ2_XXS", True, {"IQ4_NL": 150, "Q4_0": 30, "Q2_K": 3, "IQ2_XXS": 27}),  # attn_v's Q2_K falls back to Q4_0
    ("IQ3_XXS", True, {"IQ4_NL": 180, "IQ3_XXS": 30}),
    ("IQ3_XXS", False, {"IQ4_NL": 180, "Q4_K": 3, "Q3_K": 27}),
])
def test_file_type_mix_is_llama_quantizes_on_smollm2(file_type, calibrated, counts):
    types = layer_types(file_type, smollm2_shapes(), SMOLLM2, calibrated)
    assert Counter(types.values()) == counts
    if file_type == "Q4_K_M":  # use_more_bits: layers 0-2, 26-29 and every third between
        six = [i for i in range(30) if types[f"model.layers.{i}.mlp.down_proj"] == "Q6_K"]
        assert six == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
        assert {types[f"model.layers.{i}.self_attn.v_proj"] for i in six} == {"Q8_0"}  # Q6_K's fallback


def test_q4_0_with_calibration_guards_the_first_ffn_down_layers_as_llama_cpp_with_imatrix():
    plain = layer_types("Q4_0", smollm2_shapes(), SMOLLM2)
    calibrated = layer_types("Q4_0", smollm2_shapes(), SMOLLM2, calibrated=True)
    assert set(plain.values()) == {"Q4_0"}
    assert {n for n, t in calibrated.items() if t == "Q4_1"} == {f"model.layers.{i}.mlp.down_proj" for i in range(3)}


def test_file_type_mix_on_whole_super_blocks():
    types = layer_types("Q3_K_M", smollm2_shapes(layers=32, hidden=512, inter=1024, kv=128),
                        {"num_attention_heads": 8, "num_key_value_heads": 2})
    assert [types[f"model.layers.{i}.self_attn.v_proj"] for i in range(3)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert [types[f"model.layers.{i}.mlp.down_proj"] for i in range(3)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert types["model.layers.9.self_attn.o_proj"] == "Q4_K" and types["model.layers.9.mlp.up_proj"] == "Q3_K"
    q2 = layer_types("Q2_K", {"model.layers.0.self_attn.v_proj": (512, 128)}, {"num_attention_heads": 8,
                                                                                "num_key_value_heads": 2})
    assert q2 == {"model.layers.0.self_attn.v_proj": "Q4_K"}  # n_gqa >= 4
    head = {"lm_head": (512, 1000)}  # a quantized output: Q6_K, or Q8_0 in a Q8_0 file (and where 256 does not fit)
    assert [layer_types(t, head, {})["lm_head"] for t in ("Q4_K_M", "Q4_0", "Q8_0")] == ["Q6_K", "Q6_K", "Q8_0"]
    assert layer_types("Q4_K_M", {"lm_head": (576, 1000)}, {})["lm_head"] == "Q8_0"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("kquant")
    torch.manual_seed(0)
    return root, make_model_folder("llama-256", root, dtype=torch.float16), torch.randint(0, 512, (4, 64))


def test_gguf_type_writes_llama_cpps_mix_and_reads_back_in_transformers(wide):
    root, src, ids = wide
    out = root / "q4_k_m"
    api.quantize(str(src), out, QuantConfig(method="gptq", gguf_type="Q4_K_M"), calibration_ids=ids)
    reader = gguf.GGUFReader(out / "model.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert reader.fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_up.weight"] == types["blk.0.attn_v.weight"] == "Q4_K"
    assert types["blk.1.attn_v.weight"] == "Q6_K"  # the last eighth of the layers gets more bits
    assert types["blk.0.ffn_down.weight"] == "Q5_0" and types["blk.1.ffn_down.weight"] == "Q8_0"  # 288 inputs
    ours = api.load_quantized(out, device="cpu", dtype=torch.float32)  # as theirs
    theirs = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32)
    x = ids[:1, :24]
    torch.testing.assert_close(ours(x).logits, theirs(x).logits, rtol=0, atol=1e-5)


def test_gguf_type_refusals(wide):
    with pytest.raises(QuantkitError, match="--checkpoint-format gguf"):
        QuantConfig(gguf_type="Q4_K_M", checkpoint_format="gptq")
    with pytest.raises(QuantkitError, match="unknown --gguf-type"):
        QuantConfig(gguf_type="Q4_K_X")
    with pytest.raises(QuantkitError, match="drop --quantizer"):
        QuantConfig(gguf_type="Q4_K_M", quantizer="ggml")
    with pytest.raises(QuantkitError, match="sub-blocks are 16 weights wide: use --group-size 16"):
        QuantConfig(quantizer="kquant", bits=6, group_size=32, checkpoint_format="gguf")
    root, src, ids = wide
    with pytest.raises(QuantkitError, match="288.*256"):  # ffn_down's rows are not whole super-blocks
        api.quantize(str(src), root / "no", QuantConfig(quantizer="kquant", bits=4, group_size=32,
                                                        checkpoint_format="gguf"))
    assert not (root / "no").exists()


@pytest.mark.parametrize("quantizer_name", ["iq4nl", "iq4xs"])
def test_iq4_types_decode_bit_for_bit_and_beat_the_uniform_grid(quantizer_name):
    """IQ4_NL / IQ4_XS: random codes over all 16 levels and every scale decode through gguf-py's dequantize as the
    quantizer decodes them; fitted on Gaussian weights, the non-uniform levels round closer than Q4_0's grid."""
    from quantkit.gguf.types import TYPES

    quantizer = quantizer_for(quantizer_name, 4, True, 32)
    kind = TYPES[quantizer.ggml_type]
    gen = torch.Generator().manual_seed(4)
    rows, k = 3, 512
    codes = torch.randint(0, 16, (rows, k), generator=gen)
    d = (torch.rand(rows, k // kind.block, generator=gen) * 0.01).half().float()
    params = {"d": d.repeat_interleave(kind.block // 32, dim=1)}
    if quantizer_name == "iq4xs":
        params["sc"] = torch.randint(-32, 32, (rows, k // 32), generator=gen).float()
    data = kind.encode(codes, params)
    assert data.shape == (rows, k // kind.block * kind.block_bytes)
    back, back_params = kind.decode(data)
    assert torch.equal(back, codes.int()) and all(torch.equal(back_params[key], params[key]) for key in params)
    want = quantizer.dequantize(codes, {key: v[:, torch.arange(k) // 32] for key, v in params.items()})
    assert torch.equal(reference_dequantize(quantizer.ggml_type, data, kind.block), want)

    w = torch.randn(16, 512, generator=gen)
    res = rtn(w, quantizer, 32)
    assert torch.equal(reference_dequantize(quantizer.ggml_type, kind.encode(res.codes, res.params), kind.block),
                       res.dequantize())
    q4_0 = rtn(w, make_quantizer("ggml", bits=4, sym=True), 32)
    assert (res.dequantize() - w).square().mean() < 0.92 * (q4_0.dequantize() - w).square().mean()


def test_gguf_type_iq4_xs_from_the_cli(wide):
    """The command line end to end: the report's table names each layer's bits, the file llama.cpp's types (IQ4_XS
    on whole super-blocks, IQ4_NL on ffn_down's 288 inputs), read back by transformers as quantkit reads it."""
    from click.testing import CliRunner

    from quantkit.cli import main

    root, src, ids = wide
    out = root / "iq4xs"
    result = CliRunner().invoke(main, ["quantize", str(src), "-o", str(out), "--method", "rtn",
                                       "--gguf-type", "IQ4_XS"])
    assert result.exit_code == 0, result.output
    assert "in floating point: lm_head, embeddings" in result.output  # what the GGUF keeps in F16, named
    assert "| model.layers.0.mlp.down_proj | 4 | 32 |" in result.output
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / "model.gguf").tensors}
    assert types["blk.0.attn_q.weight"] == "IQ4_XS" and types["blk.0.ffn_down.weight"] == "IQ4_NL"
    ours = api.load_quantized(out, device="cpu", dtype=torch.float32)  # as theirs
    theirs = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32)
    torch.testing.assert_close(ours(ids[:1, :16]).logits, theirs(ids[:1, :16]).logits, rtol=0, atol=1e-5)

"""AWQ GEMM and compressed-tensors pack-quantized (issue 11): golden words computed by hand, folders laid out
as AutoAWQ and llm-compressor lay them out (built here from their documented layouts, no third-party code),
loaded through load_quantized, and the refusals."""
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from quantkit.api import load_quantized, quantize
from quantkit.cli import main
from quantkit.run.config import QuantConfig
from quantkit.core.errors import QuantkitError
from quantkit.checkpoint import awq, files as checkpoint, compressed_tensors as ct, gptq
from quantkit.schemes.grid import Grid
from quantkit.core.result import QuantResult

IDS = torch.tensor([[1, 5, 9, 200, 31, 7, 64, 3]])
U32 = 0xFFFFFFFF


def _result(codes, zeros, bits, group_size, sym=False):
    codes = torch.tensor(codes, dtype=torch.int32)
    zeros = torch.tensor(zeros, dtype=torch.int32)
    k = codes.shape[1]
    return QuantResult(codes=codes, params={"scale": torch.full(zeros.shape, 0.5), "zero": zeros},
                       g_idx=(torch.arange(k) // group_size).to(torch.int32), quantizer=Grid(bits, sym),
                       group_size=group_size)


def test_golden_awq_words():
    # 8 outputs, 2 inputs, one group. AWQ packs along the outputs: nibble i of a word holds output ORDER[i],
    # ORDER = [0, 2, 4, 6, 1, 3, 5, 7]. Input 0 has code n at output n -> nibbles 0,2,4,6,1,3,5,7 -> 0x75316420;
    # input 1 has code 15 - n -> nibbles 15,13,11,9,14,12,10,8 -> 0x8ACE9BDF (hex digits read from nibble 7 down).
    res = _result([[n, 15 - n] for n in range(8)], [[z] for z in range(1, 9)], 4, 2)
    t = awq.to_tensors(res)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (2, 1)
    assert [w & U32 for w in t["qweight"][:, 0].tolist()] == [0x75316420, 0x8ACE9BDF]
    # zeros 1..8 (true zeros, no -1): nibbles 1,3,5,7,2,4,6,8 -> 0x86427531
    assert t["qzeros"].shape == (1, 1) and t["qzeros"][0, 0].item() & U32 == 0x86427531
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (1, 8)
    named = {f"l.{k}": v for k, v in t.items()}
    decoded = awq.from_tensors(named, "l", 2, "test")
    assert torch.equal(decoded.codes, res.codes) and torch.equal(decoded.params["zero"], res.params["zero"])


def test_golden_compressed_tensors_words():
    # compressed-tensors >= 0.18 packs one dense bit stream: code i at stream bits [3i, 3i + 3), 32 bits a word.
    # Row 0: codes 1..7 then 0s -> octal digits lowest first, 0o7654321; code 10 (bits 30..32) is 0 -> word 1 = 0.
    # Row 1: eleven 7s -> codes 0..9 fill bits 0..29, code 10 sets bits 30, 31 (word 0 all ones) and bit 32
    # (word 1 = 1); ceil(11 * 3 / 32) = 2 words.
    res = _result([[1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0], [7] * 11], [[3], [6]], 3, -1)
    t = ct.to_tensors(res)
    assert t["weight_packed"].dtype == torch.int32 and t["weight_packed"].shape == (2, 2)
    assert t["weight_packed"].tolist() == [[0o7654321, 0], [-1, 1]]
    read = ct.from_tensors({f"l.{k}": v for k, v in t.items()}, "l", ct.weights_args(3, -1, False), "test", "0.20.0")
    assert torch.equal(read.codes, res.codes) and torch.equal(read.params["zero"], res.params["zero"])
    # zeros packed along the outputs: zero(row 0) = 3 at bits 0..2, zero(row 1) = 6 at bits 3..5 -> 0o63
    assert t["weight_zero_point"].tolist() == [[0o63]]
    assert t["weight_shape"].tolist() == [2, 11] and t["weight_shape"].dtype == torch.int64
    assert t["weight_scale"].dtype == torch.float16 and t["weight_scale"].shape == (2, 1)
    # 32 3-bit codes take 3 words (10 whole codes a word took 4): codes 1, 0, 0, ... 0, 1 -> bit 0 and bits 93..95
    # hold 1: word 0 = 1, word 2 = 1 << 29
    t32 = ct.to_tensors(_result([[1] + [0] * 30 + [1]], [[4]], 3, -1, sym=True))
    assert t32["weight_packed"].tolist() == [[1, 0, 1 << 29]]
    # 4-bit codes 1..8 of one row: 0x87654321 (stored as a negative int32); symmetric layers have no zero point
    t4 = ct.to_tensors(_result([[1, 2, 3, 4, 5, 6, 7, 8]], [[8]], 4, 8, sym=True))
    assert t4["weight_packed"][0, 0].item() & U32 == 0x87654321 and "weight_zero_point" not in t4
    # 2-bit: 17 codes of 3 -> a word of ones, then 3; 8-bit: 1..5 -> 0x04030201, 0x05
    assert ct.to_tensors(_result([[3] * 17], [[2]], 2, -1, sym=True))["weight_packed"].tolist() == [[-1, 3]]
    assert ct.to_tensors(_result([[1, 2, 3, 4, 5]], [[128]], 8, -1, sym=True))["weight_packed"].tolist() == \
        [[0x04030201, 5]]


@pytest.mark.parametrize("version", ["0.17.0", "0.12.2"])
def test_compressed_tensors_before_0_18_is_read_in_its_own_packing(version):
    """<= 0.17: 10 whole 3-bit codes a word. The word counts tell the packings apart, and where they agree (11
    codes: 2 words either way) the config's version does."""
    args = ct.weights_args(3, -1, True)
    old = {"l.weight_packed": torch.tensor([[0o7654321, 0], [0x3FFFFFFF, 7]], dtype=torch.int32),
           "l.weight_scale": torch.ones(2, 1, dtype=torch.float16), "l.weight_shape": torch.tensor([2, 11])}
    codes = ct.from_tensors(old, "l", args, "test", version).codes
    assert codes.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0], [7] * 11]
    assert ct.from_tensors(old, "l", args, "test", "0.20.0").codes[1].tolist() != [7] * 11  # read densely
    q = torch.randint(0, 8, (3, 32))
    words = torch.zeros(3, 4, dtype=torch.int64)  # 32 codes, 10 a word: 4 words (dense would be 3)
    for j in range(32):
        words[:, j // 10] |= q[:, j].long() << (3 * (j % 10))
    layer = {"l.weight_packed": words.to(torch.int32), "l.weight_scale": torch.ones(3, 1, dtype=torch.float16),
             "l.weight_shape": torch.tensor([3, 32])}
    assert torch.equal(ct.from_tensors(layer, "l", args, "test", None).codes, q.to(torch.int32))


@pytest.fixture(scope="module")
def v2_folder(model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("foreign") / "v2"
    quantize(str(model_factory("llama-tied-bias")), out,
             QuantConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2"), device="cpu")
    return out


def _logits(folder):
    with torch.no_grad():
        return load_quantized(folder, device="cpu")(IDS).logits


def _foreign_folder(src, dst, qc, layer_tensors):
    """A copy of `src` whose quantized layers are rewritten by layer_tensors(QuantResult) and whose config
    holds only `qc`, with none of quantkit's own files: what another tool would have written."""
    config, tensors, layers, _ = checkpoint.read_checkpoint(src)
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "quantkit_recipe.yaml", "quantkit_report.json", "quantize_config.json"):
            shutil.copy(f, dst / f.name)
    for layer in layers:
        res = gptq.to_result(tensors, layer.name, layer.settings, "gptq_v2")
        for s in ("qweight", "qzeros", "scales", "g_idx"):
            del tensors[f"{layer.name}.{s}"]
        tensors.update({f"{layer.name}.{k}": v for k, v in layer_tensors(res).items()})
    checkpoint.write_tensors(dst, tensors, 10**9)
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _autoawq_tensors(res):
    """WQLinear_GEMM.from_linear's packing, written out: word c of row k ORs code[k, 8c + ORDER[i]] << 4i."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack(x):  # x [R, N] -> [R, N / 8]
        words = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int64)
        for c in range(x.shape[1] // 8):
            for i in range(8):
                words[:, c] |= x[:, 8 * c + order[i]].long() << (4 * i)
        return (words - (words >= 2**31) * 2**32).to(torch.int32)

    return {"qweight": pack(res.codes.t()), "qzeros": pack(res.params["zero"].t()),
            "scales": res.params["scale"].t().half()}


def _llmcompressor_tensors(res):
    """pack_to_int32's layout, written out: signed value + 8 is the unsigned code, 8 codes per word along the
    inputs (zeros: along the outputs), code i at bits 4i."""
    def pack(x, dim):  # pack along dim 1 of x moved so that the packed dim is last
        x = x.movedim(dim, -1).long()
        words = torch.zeros(*x.shape[:-1], -(-x.shape[-1] // 8), dtype=torch.int64)
        for j in range(x.shape[-1]):
            words[..., j // 8] |= x[..., j] << (4 * (j % 8))
        return (words - (words >= 2**31) * 2**32).to(torch.int32).movedim(-1, dim)

    n, k = res.codes.shape
    return {"weight_packed": pack(res.codes, 1), "weight_zero_point": pack(res.params["zero"], 0),
            "weight_scale": res.params["scale"].half(), "weight_shape": torch.tensor([n, k])}


def test_autoawq_folder_loads(v2_folder, tmp_path):
    qc = {"quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4, "version": "gemm",
          "modules_to_not_convert": None}
    folder = _foreign_folder(v2_folder, tmp_path / "awq", qc, _autoawq_tensors)
    assert torch.equal(_logits(folder), _logits(v2_folder))


LLMCOMPRESSOR_QC = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "version": "0.12.2", "sparsity_config": {}, "transform_config": {}, "kv_cache_scheme": None,
    "global_compression_ratio": None, "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "format": "pack-quantized", "weights": {
                                      "num_bits": 4, "type": "int", "symmetric": False, "group_size": 32,
                                      "strategy": "group", "block_structure": None, "dynamic": False, "actorder": None,
                                      "observer": "minmax", "observer_kwargs": {}}}}}


def test_llmcompressor_folder_loads(v2_folder, tmp_path):
    folder = _foreign_folder(v2_folder, tmp_path / "ct", LLMCOMPRESSOR_QC, _llmcompressor_tensors)
    assert torch.equal(_logits(folder), _logits(v2_folder))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llmcompressor_fp32_and_bf16_scales_are_read_without_rounding(v2_folder, tmp_path, capsys, dtype):
    """A folder llm-compressor made from an fp32 (or bf16) model: its scales run as stored (fp32 ones float16
    cannot hold are kept, and said so); logits equal an fp32 model holding scale * (q - z)."""
    qc = json.loads(json.dumps(LLMCOMPRESSOR_QC))
    written = []

    def tensors(res):
        t = _llmcompressor_tensors(res)
        t["weight_scale"] = (res.params["scale"].double() * (1 + 2**-13)).to(dtype)  # off the fp16 grid
        g = res.g_idx.long()
        written.append(t["weight_scale"].double()[:, g] * (res.codes - res.params["zero"][:, g]).double())
        return t

    folder = _foreign_folder(v2_folder, tmp_path / "ct", qc, tensors)
    got = _logits(folder)
    said = capsys.readouterr().err
    assert ("float32 scales that float16 cannot hold exactly" in said) == (dtype == torch.float32)
    reference = load_quantized(v2_folder, device="cpu")
    for layer, w in zip(checkpoint.read_checkpoint(v2_folder)[2], written):
        parent, _, leaf = layer.name.rpartition(".")
        old = reference.get_submodule(layer.name)
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=old.bias is not None)
        linear.weight.data = w.float()
        if old.bias is not None:
            linear.bias.data = old.bias.float()
        setattr(reference.get_submodule(parent), leaf, linear)
    with torch.no_grad():
        torch.testing.assert_close(got, reference(IDS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["awq", "compressed-tensors"])
def test_quantize_writes_and_reads_back(model_factory, tmp_path, v2_folder, fmt):
    out = tmp_path / fmt
    quantize(str(model_factory("llama-tied-bias")), out,
             QuantConfig(bits=4, group_size=32, sym=False, checkpoint_format=fmt), device="cpu")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == fmt
    assert torch.equal(_logits(out), _logits(v2_folder))
    shown = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["layers"]["model.layers.0.mlp.down_proj"]["bits"] == 4


def test_3bit_compressed_tensors_round_trip(model_factory, tmp_path):
    """Written in the dense 3-bit packing and read back: the logits of the same run written as gptq_v2."""
    src = str(model_factory("llama-tied-bias"))
    for fmt in ("compressed-tensors", "gptq_v2"):
        quantize(src, tmp_path / fmt, QuantConfig(bits=3, group_size=32, sym=False, checkpoint_format=fmt), device="cpu")
    packed = checkpoint.read_tensors(tmp_path / "compressed-tensors")["model.layers.0.mlp.down_proj.weight_packed"]
    assert packed.shape[1] == 9  # 96 inputs of 3 bits: 9 words (10 whole codes a word took 10)
    assert torch.equal(_logits(tmp_path / "compressed-tensors"), _logits(tmp_path / "gptq_v2"))


def test_awq_names_output_widths_no_group_size_fixes(tmp_path):
    from quantkit.demo import bundled_model_path

    with pytest.raises(QuantkitError) as err:  # stories260k: every gate_proj has 172 outputs
        quantize(bundled_model_path(), tmp_path / "q", QuantConfig(method="rtn", group_size=32, checkpoint_format="awq"))
    assert "172 outputs, not a multiple of 8, which no --group-size changes" in str(err.value)
    assert "pick" not in str(err.value)


@pytest.mark.parametrize("settings,words", [
    (dict(checkpoint_format="awq", bits=3), ["awq stores 4-bit codes only", "--bits 4"]),
    (dict(checkpoint_format="awq", group_size=-1), ["group size dividing", "compressed-tensors"]),
    (dict(checkpoint_format="awq", group_size=48), ["group size dividing", "such as 64"]),
    (dict(checkpoint_format="compressed-tensors", rotate="hadamard"), ["unrotated integer grids only"]),
    (dict(checkpoint_format="awq", method="turboquant"), ["unrotated integer grids only"]),
    (dict(checkpoint_format="awq", modules=[{"pattern": "down_proj", "bits": 8}]), ["one bits/group_size"]),
])
def test_write_refusals(model_factory, tmp_path, settings, words):
    with pytest.raises(QuantkitError) as err:
        quantize(str(model_factory("llama")), tmp_path / "q", QuantConfig(**settings), device="cpu")
    for w in words:
        assert w in str(err.value), str(err.value)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("fmt,edit,words", [
    ("awq", {"version": "gemv"}, ["version 'gemv'", "GEMM"]),
    ("awq", {"zero_point": False}, ["zero_point False"]),
    ("compressed-tensors", {"format": "float-quantized"}, ["format 'float-quantized'"]),
    ("compressed-tensors", {"kv_cache_scheme": {"num_bits": 8}}, ["kv_cache_scheme"]),
    ("compressed-tensors", {"config_groups": {"g": {"targets": ["Linear"], "input_activations": {"num_bits": 8},
                                                    "weights": {"num_bits": 4, "strategy": "group"}}}},
     ["quantizes activations", "weight-only"]),
])
def test_read_refusals(model_factory, tmp_path, fmt, edit, words):
    out = tmp_path / fmt
    quantize(str(model_factory("llama")), out, QuantConfig(bits=4, group_size=32, checkpoint_format=fmt), device="cpu")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"].update(edit)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError) as err:
        load_quantized(out, device="cpu")
    for w in words:
        assert w in str(err.value), str(err.value)

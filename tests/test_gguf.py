"""--checkpoint-format gguf (issue 39): llama.cpp's file, read back by two independent readers (gguf-py's
GGUFReader, transformers' GGUF loader, which dequantizes with gguf-py and undoes llama's q/k reordering itself)."""
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit import api
from quantkit.core.errors import QuantkitError
from quantkit.gguf import file as gguf_file
from quantkit.gguf.arch import rotary_rows
from quantkit.gguf.legacy import GGMLBlocks
from quantkit.run.config import QuantConfig
from test_resume import assert_same_checkpoint, cli, killed
from tiny_models import make_model_folder

gguf = pytest.importorskip("gguf")  # the test extra's reference reader: without it (a GPU image) these skip

TYPES = {  # block type -> the settings that write it
    "Q4_0": dict(method="gptq", bits=4),
    "Q8_0": dict(method="rtn", bits=8),
    "Q4_1": dict(method="gptq", quantizer="ggml", bits=4, sym=False),
    "Q5_0": dict(method="rtn", quantizer="ggml", bits=5),
    "Q5_1": dict(method="gptq", quantizer="ggml", bits=5, sym=False),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    torch.manual_seed(0)
    return root, make_model_folder("llama-gqa", root, dtype=torch.float16), torch.randint(0, 512, (4, 64))


def quantized(world, kind, **extra):
    root, src, ids = world
    out = root / f"{kind}-{'-'.join(map(str, extra.values()))}"
    if not out.exists():
        api.quantize(str(src), out, QuantConfig(**TYPES[kind], group_size=32, checkpoint_format="gguf", **extra),
                     calibration_ids=ids)
    return out


@pytest.mark.parametrize("kind", list(TYPES))
def test_each_block_type_reads_back_the_same_in_transformers_and_gguf_py(world, kind):
    out = quantized(world, kind)
    assert sorted(p.name for p in out.glob("*.gguf")) == ["model.gguf"] and not list(out.glob("*.safetensors"))
    reader = gguf.GGUFReader(out / "model.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == kind
    assert types["token_embd.weight"] == types["output.weight"] == "F16" and types["output_norm.weight"] == "F32"
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2

    ours = api.load_quantized(out, device="cpu", dtype=torch.float32)  # as theirs
    theirs = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32)
    x = world[2][:1, :24]
    torch.testing.assert_close(ours(x).logits, theirs(x).logits, rtol=0, atol=1e-5)
    # gguf-py's dequantize of a permuted q_proj is ours, rows reordered as llama.cpp's converter reorders them
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    theirs_q = torch.from_numpy(gguf.quants.dequantize(q.data, q.tensor_type)).reshape(64, 64)
    ours_q = ours.model.layers[0].self_attn.q_proj.weight.detach()
    assert torch.equal(theirs_q, ours_q[rotary_rows(64, 4)])


def test_a_tied_model_with_biases_reads_back_the_same_in_transformers(tmp_path):
    src = make_model_folder("llama-tied-bias", tmp_path, dtype=torch.float16)
    api.quantize(str(src), tmp_path / "out", QuantConfig(method="rtn", group_size=32, checkpoint_format="gguf"))
    names = {t.name for t in gguf.GGUFReader(tmp_path / "out" / "model.gguf").tensors}
    assert "output.weight" not in names and {"blk.0.attn_q.bias", "blk.0.ffn_down.bias"} <= names  # tied: one table
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf", dtype=torch.float32)
    x = torch.arange(20)[None]
    ours = api.load_quantized(tmp_path / "out", device="cpu", dtype=torch.float32)  # as theirs
    torch.testing.assert_close(ours(x).logits, theirs(x).logits, rtol=0, atol=1e-5)


def test_gptq_feedback_in_q4_1_beats_rounding_to_nearest(world):
    """The file holds what the run's error feedback chose: GPTQ's Q4_1 model is closer to the float model on its
    calibration windows than rounding to nearest with the same quantizer."""
    root, src, ids = world
    gptq = quantized(world, "Q4_1")
    rtn = root / "q41-rtn"
    api.quantize(str(src), rtn, QuantConfig(method="rtn", quantizer="ggml", bits=4, sym=False, group_size=32,
                                            checkpoint_format="gguf"), calibration_ids=ids)
    layers = json.loads((gptq / api.REPORT_NAME).read_text())["layers"]
    assert all(r["quantizer"] == "ggml" and r["bits_per_weight"] == 5.0 for r in layers.values())  # 4 + 2 x 16 / 32
    with torch.no_grad():
        fp = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        errors = {f.name: (api.load_quantized(f, device="cpu", dtype=torch.float32)(ids).logits - fp).pow(2).mean()
                  .item() for f in (gptq, rtn)}
    assert errors[gptq.name] < 0.8 * errors[rtn.name], errors


def test_q4_1_blocks_round_no_worse_than_their_range_fit():
    """Each block's d and m (fp16, as stored) round it with no more error than the fit that covers its range exactly
    (which clamps nothing); codes stay in 0..15."""
    torch.manual_seed(1)
    w = torch.randn(64, 32) * torch.rand(64, 1) + torch.randn(64, 1)
    q = GGMLBlocks(4, sym=False)
    params = q.fit(w)
    codes, wq = q.round(w, params)
    assert torch.equal(params["d"], params["d"].half().float()) and torch.equal(params["m"], params["m"].half().float())
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    ranged = q.range_fit(w)
    _, ranged_wq = q.round(w, ranged)
    assert bool(((w - ranged_wq).abs() <= ranged["d"][:, None] / 2 * (1 + 1e-5)).all())  # it clamps nothing
    assert ((w - wq).square().sum(-1) <= (w - ranged_wq).square().sum(-1) * (1 + 1e-6)).all()


def test_a_gptq_checkpoint_of_groups_of_32_converts_to_q4_0_exactly(world):
    root, src, ids = world
    gptq = root / "gptq-g32"
    api.quantize(str(src), gptq, QuantConfig(method="gptq", bits=4, group_size=32), calibration_ids=ids)
    out = root / "converted.gguf-folder"
    api.convert(gptq, out, "gguf")
    x = ids[:1, :24]
    assert torch.equal(api.load_quantized(gptq, device="cpu", dtype=torch.float32)(x).logits,
                       api.load_quantized(out, device="cpu", dtype=torch.float32)(x).logits)
    with pytest.raises(QuantkitError, match="load_quantized and `quantkit eval` read it"):
        api.convert(out, root / "back", "gptq")


def test_tokenizer_metadata_is_the_tokenizers_own(world):
    out = quantized(world, "Q8_0")
    reader = gguf.GGUFReader(out / "model.gguf")
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert tokens == [tokenizer.convert_ids_to_tokens(i) for i in range(512)]
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert types[3] == 6 and tokens[3] == "<0x00>" and types[1] == 3  # a byte token; <s> is a control token
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.bos_token_id"].contents() == tokenizer.bos_token_id
    assert reader.fields["tokenizer.ggml.padding_token_id"].contents() == tokenizer.pad_token_id  # llama.cpp's key
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is True  # the tokenizer adds <s>


def test_smollm2s_pre_tokenizer_is_recognised_as_llama_cpp_names_it():
    folder = Path(os.path.expanduser("~/.cache/quantkit-assets/smollm2-135m"))
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("SmolLM2 is built by ../shared/assets/get-smollm2.sh")
    from quantkit.gguf.vocab import vocab_metadata

    meta = {k: v for k, _, v in vocab_metadata(AutoTokenizer.from_pretrained(folder), 49152)}
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.merges"][1]) > 40000


def test_rotary_rows_are_llama_cpps_permutation():
    rows, heads = 24, 3
    w = torch.arange(rows * 5).reshape(rows, 5)
    theirs = w.reshape(heads, 2, rows // heads // 2, 5).swapaxes(1, 2).reshape(rows, 5)  # convert_hf_to_gguf's permute
    assert torch.equal(w[rotary_rows(rows, heads)], theirs)
    assert torch.equal(theirs[rotary_rows(rows, heads, inverse=True)], w)


def test_the_container_round_trips_through_gguf_py(tmp_path):
    path = tmp_path / "x.gguf"
    data = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    meta = [("general.architecture", gguf_file.STRING, "llama"), ("a.u", gguf_file.UINT32, 7),
            ("a.f", gguf_file.FLOAT32, 0.5), ("a.list", gguf_file.ARRAY, (gguf_file.INT32, [1, -2, 3])),
            ("a.words", gguf_file.ARRAY, (gguf_file.STRING, ["x", "yé"]))]
    info = gguf_file.TensorInfo("t.weight", (3, 4), gguf_file.F32, 48)
    gguf_file.write_gguf(path, meta, [info, gguf_file.TensorInfo("u", (5,), gguf_file.F32, 20)],
                         lambda i, out: out.write(data.numpy().tobytes() if i.name == "t.weight" else bytes(20)))
    reader = gguf.GGUFReader(path)
    assert reader.fields["a.u"].contents() == 7 and reader.fields["a.list"].contents() == [1, -2, 3]
    assert reader.fields["a.words"].contents() == ["x", "yé"]
    t = reader.tensors[0]
    assert t.name == "t.weight" and list(t.shape) == [4, 3] and (t.data == data.numpy()).all()
    ours, infos, _ = gguf_file.read_gguf(path, lambda kind, shape: 4 * int(torch.tensor(shape).prod()))
    assert ours["a.words"] == ["x", "yé"] and infos[0].shape == (3, 4) and infos[1].offset % 32 == 0


@pytest.mark.parametrize("settings,words", [
    (dict(method="gptq", bits=4, group_size=128), "groups of 128"),
    (dict(method="rtn", bits=3, group_size=32), "3-bit int"),
    (dict(method="rtn", bits=4, group_size=32, rotate="hadamard"), "llama.cpp applies no rotation"),
])
def test_what_llama_cpp_cannot_hold_is_refused_before_any_work(world, settings, words):
    root, src, ids = world
    with pytest.raises(QuantkitError, match=words):
        api.quantize(str(src), root / "refused", QuantConfig(**settings, checkpoint_format="gguf"),
                     calibration_ids=ids)
    assert not (root / "refused").exists()


def test_an_architecture_llama_cpp_is_not_given_is_refused(tmp_path):
    src = make_model_folder("opt", tmp_path)
    with pytest.raises(QuantkitError, match="writes llama, mistral, qwen2, qwen3 models; this one is 'opt'"):
        api.quantize(str(src), tmp_path / "out", QuantConfig(method="rtn", group_size=32, checkpoint_format="gguf"))


def test_a_killed_gguf_run_resumes_to_the_same_file(tmp_path):
    src = make_model_folder("llama-deep", tmp_path, dtype=torch.float16)
    argv = ["quantize", src, "-o", None, "--method", "rtn", "--group-size", 32, "--checkpoint-format", "gguf"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert cli(*[ref if a is None else a for a in argv]).exit_code == 0
    killed((tmp_path,), out, "block-00001", [out if a is None else a for a in argv])
    result = cli(*[out if a is None else a for a in argv], "--resume")
    assert result.exit_code == 0 and "blocks 0-1 of 4 are done" in result.output, result.output
    assert_same_checkpoint(ref, out)

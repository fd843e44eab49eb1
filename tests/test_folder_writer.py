"""quantize and convert write their folders through one writer (quantkit.run.folder, issue 61): converting a quantize
output to the layout it already has gives back quantize's files, config files and shards byte for byte (only the
run records differ: convert's report, and no recipe, as convert quantizes nothing); both honour the shard size;
quantize_config.json is written for the formats whose codec says so; a failure leaves nothing behind."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.api import quantize
from quantkit.checkpoint import codecs, shards
from quantkit.checkpoint import files as checkpoint
from quantkit.core.folders import INDEX_NAME
from quantkit.run import folder as checkpoint_folder
from quantkit.run.config import QuantConfig
from quantkit.run.convert import convert

SKIP = [{"pattern": r"layers\.0\.mlp\.down_proj", "skip": True}]  # a linear left in float: the skip lists are filled
SHARD = 20_000  # bytes: the tiny model's 131 kB embedding gets a shard of its own, the rest several
# every layout quantize writes that convert writes from its own output too (convert reads safetensors folders only)
SAME_LAYOUT = [f for f in codecs.write_formats() if codecs.codec_of_format(f).safetensors]
RUN_RECORDS = {checkpoint.RECIPE_NAME, checkpoint.REPORT_NAME}


@pytest.fixture(scope="module")
def quantized(model_factory, tmp_path_factory):
    """quantized(fmt) -> a quantize output in `fmt`, sharded at SHARD bytes (made once per format)."""
    root, made = tmp_path_factory.mktemp("writer"), {}

    def make(fmt):
        if fmt not in made:
            made[fmt] = root / fmt
            config = QuantConfig(bits=4, group_size=32, sym=fmt != "gptq_v2", checkpoint_format=fmt, modules=SKIP,
                                 max_shard_size=str(SHARD))
            quantize(str(model_factory("llama-tied-bias")), made[fmt], config, device="cpu")
        return made[fmt]
    return make


def _data_bytes(path) -> list[int]:
    """The byte size of each tensor a safetensors file holds."""
    _, header = shards.read_header(path)
    return [info["data_offsets"][1] - info["data_offsets"][0] for info in header.values()]


def assert_shards_within(folder, max_bytes: int) -> None:
    """Several shards named by the index, each at most max_bytes of tensor data unless it holds one tensor alone."""
    weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 2 and files == sorted(p.name for p in folder.glob("*.safetensors"))
    for name in files:
        sizes = _data_bytes(folder / name)
        assert sum(sizes) <= max_bytes or len(sizes) == 1, name


@pytest.mark.parametrize("fmt", SAME_LAYOUT)
def test_convert_to_its_own_layout_gives_back_quantizes_files(quantized, tmp_path, fmt):
    src = quantized(fmt)
    report = convert(src, tmp_path / "c", fmt)
    written = {p.name for p in (tmp_path / "c").iterdir()}
    assert written == {p.name for p in src.iterdir()} - {checkpoint.RECIPE_NAME}
    assert (checkpoint.QUANTIZE_CONFIG in written) == codecs.codec_of_format(fmt).writes_quantize_config
    for name in sorted(written - RUN_RECORDS):  # configs, sidecars, every shard and the index
        assert (tmp_path / "c" / name).read_bytes() == (src / name).read_bytes(), name
    assert sorted(report["files"]) == sorted(written)


def test_quantize_config_json_only_where_its_readers_look(quantized):
    """AutoGPTQ and GPTQModel read the GPTQ layout's config from quantize_config.json; AutoAWQ and compressed-tensors
    folders have none (and AutoGPTQ would take one for a GPTQ config)."""
    assert (quantized("gptq") / checkpoint.QUANTIZE_CONFIG).is_file()
    assert json.loads((quantized("gptq") / checkpoint.QUANTIZE_CONFIG).read_text()) == \
        json.loads((quantized("gptq") / "config.json").read_text())["quantization_config"]
    for fmt in ("awq", "compressed-tensors"):
        assert not (quantized(fmt) / checkpoint.QUANTIZE_CONFIG).exists()


def test_both_commands_honour_the_shard_size(quantized, tmp_path):
    src = quantized("gptq")
    assert_shards_within(src, SHARD)
    convert(src, tmp_path / "awq", "awq", max_shard_size="30KB")  # another layout, another size
    assert_shards_within(tmp_path / "awq", 30_000)
    # without a recipe that says what the source was written with: quantize's default (4GB), one file
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    (bare / checkpoint.RECIPE_NAME).unlink()
    convert(bare, tmp_path / "one", "compressed-tensors")
    assert sorted(p.name for p in (tmp_path / "one").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "one" / INDEX_NAME).exists()


def test_tensors_the_model_does_not_load_are_carried_by_convert(model_factory, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(model_factory("llama"), src)
    extra = {"mtp.eh_proj.weight": torch.randn(16, 8).to(torch.bfloat16), "mtp.norm.weight": torch.ones(8)}
    save_file({**load_file(src / "model.safetensors"), **extra}, src / "model.safetensors", metadata={"format": "pt"})
    quantize(str(src), tmp_path / "q", QuantConfig(bits=4, group_size=32), device="cpu")
    report = convert(tmp_path / "q", tmp_path / "c", "compressed-tensors")
    assert report["carried"] == checkpoint.read_report(tmp_path / "q")["carried"] == sorted(extra)
    stored = checkpoint.read_tensors(tmp_path / "c", list(extra))
    assert all(stored[n].dtype == t.dtype and torch.equal(stored[n], t) for n, t in extra.items())


@pytest.mark.parametrize("command", ["quantize", "convert"])
def test_a_failure_while_writing_the_folder_leaves_nothing(quantized, model_factory, tmp_path, monkeypatch, command):
    """The writer writes into the staging folder only: OUT appears whole, or not at all."""
    def fail(folder, spec, report):
        raise RuntimeError("disk gone")
    monkeypatch.setattr(checkpoint_folder, "write_rest", fail)
    out = tmp_path / "world" / "out"
    with pytest.raises(RuntimeError, match="disk gone"):
        if command == "quantize":
            quantize(str(model_factory("llama")), out, QuantConfig(bits=4, group_size=32), device="cpu")
        else:
            convert(quantized("gptq"), out, "awq")
    assert not out.exists() and not (tmp_path / "world").exists()

"""Sharded folders with a wrong or missing index (issue 17): loading a quantized checkpoint and quantizing a
sharded source refuse them with one error naming the tensor and the files, and leave nothing behind."""
import json
import shutil

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantkit.cli import main
from quantkit.core.errors import QuantkitError
from quantkit.core.folders import INDEX_NAME
from quantkit.run.load import load_quantized
from test_destructive import snapshot


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def sharded(model_factory, tmp_path_factory):
    """(a sharded fp source: the tiny model's tensors dealt over 4 shards with an index; a sharded quantized
    checkpoint of it)."""
    root = tmp_path_factory.mktemp("sharded")
    src = root / "src"
    shutil.copytree(model_factory("llama"), src)
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = list(tensors)
    groups = [names[i::4] for i in range(4)]
    weight_map = {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-00004.safetensors"
        save_file({n: tensors[n] for n in group}, src / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    (src / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    quant = root / "quant"
    result = cli("quantize", src, "-o", quant, "--group-size", 32, "--max-shard-size", "20KB")
    assert result.exit_code == 0, result.output
    assert len(list(quant.glob("model-*.safetensors"))) > 2
    return src, quant


def tamper(folder, how):
    """Break a sharded folder `how`; returns words the error must contain."""
    index = json.loads((folder / INDEX_NAME).read_text())
    wm = index["weight_map"]
    files = sorted(set(wm.values()))
    name = next(n for n in wm if n.endswith("norm.weight"))
    if how == "missing shard":
        (folder / files[1]).unlink()
        return [files[1], "missing"]
    if how == "no index":
        (folder / INDEX_NAME).unlink()
        return ["no " + INDEX_NAME]
    if how == "damaged index":
        (folder / INDEX_NAME).write_text('{"weight_map": ')
        return [INDEX_NAME, "damaged"]
    if how == "wrong shard":
        other = next(f for f in files if f != wm[name])
        right, wm[name] = wm[name], other
        (folder / INDEX_NAME).write_text(json.dumps(index))
        return [name, other, f"it is in {right}"]
    if how == "unlisted tensor":
        fname = wm.pop(name)
        (folder / INDEX_NAME).write_text(json.dumps(index))
        return [name, fname, "does not list"]
    if how == "listed, not held":
        wm["model.layers.9.mlp.up_proj.weight"] = files[0]
        (folder / INDEX_NAME).write_text(json.dumps(index))
        return ["model.layers.9.mlp.up_proj.weight", "no shard holds it"]
    if how == "shape mismatch":
        fname = wm[name]
        tensors = load_file(folder / fname)
        tensors[name] = tensors[name][:-1].clone()
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        return [name, "[63]", "[64]"]
    raise ValueError(how)


CASES = ["missing shard", "no index", "damaged index", "wrong shard", "unlisted tensor", "listed, not held",
         "shape mismatch"]


@pytest.mark.parametrize("how", CASES)
def test_loading_a_checkpoint_with_a_bad_index_is_refused_by_name(sharded, tmp_path, how):
    folder = tmp_path / "quant"
    shutil.copytree(sharded[1], folder)
    words = tamper(folder, how)
    before = snapshot(tmp_path)
    with pytest.raises(QuantkitError) as e:
        load_quantized(folder, device="cpu")
    for w in words:
        assert w in str(e.value), str(e.value)
    if how == "shape mismatch":  # inspect builds no model: only loading can see a float tensor's shape is wrong
        return
    result = cli("inspect", folder)
    assert result.exit_code == 2 and result.output.startswith("error: ") and "Traceback" not in result.output
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("how", CASES)
def test_quantizing_a_source_with_a_bad_index_is_refused_by_name(sharded, tmp_path, monkeypatch, how):
    src = tmp_path / "src"
    shutil.copytree(sharded[0], src)
    words = tamper(src, how)
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = cli("quantize", src, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: "), result.output
    for w in words:
        assert w in result.output, result.output
    assert snapshot(tmp_path) == before  # no OUT, no staging folder, the source untouched

"""load_quantized's device, device_map and dtype as transformers takes them, and the one function that decides what runs
each quantized layer (kernels.dispatch.layer_backend): its choices and reasons, the loader and the modules following
it, and `quantkit inspect` showing it."""
import json

import pytest
import torch
from click.testing import CliRunner

import quantkit
from quantkit.core.errors import QuantkitError
from quantkit.demo import bundled_model_path
from quantkit.kernels import dispatch
from quantkit.kernels.dispatch import LayerFacts, layer_backend
from quantkit.nn.cpu_int4_linear import CpuInt4Linear
from quantkit.run.load import placement_of
from tiny_models import make_model_folder

RTN = quantkit.QuantConfig(method="rtn", bits=4, group_size=32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """RTN w4 g32 checkpoints of a tiny Llama stored in bfloat16 and in float16."""
    root = tmp_path_factory.mktemp("dtypes")
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        src = make_model_folder("llama-tied-bias", root / str(dtype), dtype=dtype)
        out[dtype] = root / f"q-{dtype}"
        quantkit.quantize(str(src), out[dtype], RTN, device="cpu")
    return out


def float_dtypes(model) -> set:
    """The dtypes of the float parameters (embeddings, norms) and the quantized layers' biases."""
    tensors = list(model.parameters()) + [b for n, b in model.named_buffers() if n.endswith(".bias")]
    return {t.dtype for t in tensors if t.is_floating_point()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_default_dtype_is_the_checkpoints_own(checkpoints, dtype):
    model = quantkit.load_quantized(checkpoints[dtype], device="cpu")
    assert float_dtypes(model) == {dtype}
    repacked = [m for m in model.modules() if isinstance(m, CpuInt4Linear)]
    # the int4 GEMM's own scales are held only where it runs: for bf16 activations
    assert repacked and all((m.kernel_scales is not None) == (dtype == torch.bfloat16) for m in repacked)
    for asked in (torch.float32, "float32", "fp32", "torch.float32"):
        assert float_dtypes(quantkit.load_quantized(checkpoints[dtype], device="cpu", dtype=asked)) == {torch.float32}


def test_without_a_declared_dtype_the_stored_float_tensors_say_it(checkpoints, tmp_path):
    import shutil

    folder = tmp_path / "q"
    shutil.copytree(checkpoints[torch.bfloat16], folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config))
    assert float_dtypes(quantkit.load_quantized(folder, device="cpu")) == {torch.bfloat16}


def test_a_dtype_that_is_no_float_is_named(checkpoints):
    with pytest.raises(QuantkitError, match="dtype='int8'"):
        quantkit.load_quantized(checkpoints[torch.float16], dtype="int8")
    with pytest.raises(QuantkitError, match="give one of them"):
        quantkit.load_quantized(checkpoints[torch.float16], dtype="bfloat16", torch_dtype=torch.float16)


def test_device_and_device_map_must_agree():
    assert placement_of() == ("cpu", None)  # as transformers' from_pretrained
    assert placement_of("auto") == (("cuda" if torch.cuda.is_available() else "cpu"), None)
    for device, device_map in [("cpu", None), (torch.device("cpu"), "cpu"), ("auto", "cpu"), ("cpu", {"": "cpu"}),
                               ("auto", {"model": "cpu", "lm_head": torch.device("cpu")})]:
        assert placement_of(device, device_map) == ("cpu", None)
    for device, device_map in [("cpu", "cuda:0"), ("cpu", "auto"), ("cuda:0", "balanced"), ("cuda:1", "cuda")]:
        with pytest.raises(QuantkitError, match="disagree: give one of them"):
            placement_of(device, device_map)
    with pytest.raises(QuantkitError, match="several devices"):
        placement_of("auto", {"model": "cpu", "lm_head": "cuda:0"})
    with pytest.raises(QuantkitError, match="give a device such as"):
        placement_of(1.5)
    if not torch.cuda.is_available():
        with pytest.raises(QuantkitError, match="no CUDA GPU is visible"):
            placement_of(0)  # a GPU index, as torch reads it


GRID = LayerFacts(256, 64, 4, 128)


@pytest.mark.parametrize("facts, dtype, name, words", [
    (GRID, torch.bfloat16, "cpu_int4", "int4 GEMM for bfloat16 calls"),
    (GRID, torch.float16, "cpu_int4", "float16 activations decode exact strips"),
    (GRID._replace(out_features=40), torch.bfloat16, "strips", "40 outputs, not a multiple of 16"),
    (GRID._replace(group_size=16), torch.bfloat16, "strips", "groups of 16 inputs"),
    (GRID._replace(groups="scattered"), torch.bfloat16, "strips", "act-order groups of unequal sizes"),
    (GRID._replace(groups="sorted", bits=8), torch.bfloat16, "cpu_int4", "int4 GEMM"),
    (GRID._replace(codebook="lookup"), torch.bfloat16, "strips", "by table lookup"),
    (GRID._replace(codebook="quantizer", kernel=False), torch.float32, "strips", "through its quantizer"),
])
def test_on_the_cpu(facts, dtype, name, words):
    backend = layer_backend(facts, "cpu", dtype)
    assert backend.name == name and words in backend.reason, backend
    assert layer_backend(facts, "cpu", dtype, cache_dequantized=True).name == "dense"


@pytest.mark.parametrize("facts, dtype, name, words", [
    (GRID, torch.float16, "triton", "CUDA, float16 activations: Triton dequant-GEMM"),
    (GRID._replace(codebook="lookup"), torch.bfloat16, "triton", "codebook dequant-GEMM"),
    (GRID, torch.float32, "reference", "float32 activations (the Triton kernels take float16 and bfloat16)"),
    (GRID._replace(scales=torch.bfloat16), torch.float16, "reference", "bfloat16 scales"),
    (GRID._replace(codebook="quantizer", kernel=False), torch.float16, "strips", "no Triton kernel decodes"),
])
def test_on_a_gpu_by_its_predicates(monkeypatch, facts, dtype, name, words):
    """Only strings are read of the device: the CUDA choices hold on any machine."""
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    backend = layer_backend(facts, "cuda:1", dtype)
    assert backend.name == name and words in backend.reason, backend
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    if name == "triton":
        assert "triton is not installed" in layer_backend(facts, torch.device("cuda", 0), dtype).reason


def test_a_forced_backend(monkeypatch):
    monkeypatch.setenv("QUANTKIT_BACKEND", "torch")
    assert layer_backend(GRID, "cpu", torch.bfloat16) == ("strips", "QUANTKIT_BACKEND=torch: decoded a strip at a "
                                                                   "time, exactly")
    assert layer_backend(GRID, "cuda", torch.float16).name == "reference"
    monkeypatch.setenv("QUANTKIT_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        layer_backend(GRID, "cpu", torch.float32)


def test_inspect_shows_the_backend_the_loader_takes(tmp_path):
    """stories260k's gate/up projections have 172 outputs (no multiple of 16: strips), the other linears go to the
    int4 GEMM; the loader repacks exactly the layers inspect names, and the JSON and the table say the same."""
    from quantkit.cli import main

    quantkit.quantize(str(bundled_model_path()), tmp_path / "q", RTN, device="cpu")
    info = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path / "q"), "--json"]).output)
    assert info["runs_on"] == {"device": placement_of("auto")[0], "dtype": "float32"}
    layers = info["layers"]
    if info["runs_on"]["device"] == "cpu":
        assert {r["backend"] for r in layers.values()} == {"cpu_int4", "strips"}
        assert "172 outputs, not a multiple of 16" in layers["model.layers.0.mlp.up_proj"]["backend_reason"]
    model = quantkit.load_quantized(tmp_path / "q")
    repacked = {name for name in layers if isinstance(model.get_submodule(name), CpuInt4Linear)}
    assert repacked == {name for name, r in layers.items() if r["backend"] == "cpu_int4"}
    table = CliRunner().invoke(main, ["inspect", str(tmp_path / "q")]).output
    assert "| backend |" in table
    for backend in {(r["backend"], r["backend_reason"]) for r in layers.values()}:
        n = sum((r["backend"], r["backend_reason"]) == backend for r in layers.values())
        assert f"  {backend[0]} ({n} layers): {backend[1]}" in table

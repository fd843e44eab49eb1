"""load_quantized models generate: same greedy tokens as the fake-quant reference (CPU; CUDA when present)."""
import pytest
import torch

from quantkit.api import quantize
from quantkit.run.config import QuantConfig
from quantkit.run.load import load_quantized
from quantkit.models.hub import load_fp_model
from quantkit.calibration.sequential import get_weight, set_weight
from quantkit.schemes.grid import Grid
from quantkit.algorithms.rtn import rtn

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def checkpoint(model_factory, tmp_path_factory):
    src = model_factory("llama-gqa")
    out = tmp_path_factory.mktemp("gen") / "q"
    quantize(str(src), out, QuantConfig(method="rtn", bits=4, group_size=32), device="cpu")
    return src, out


def fake_quant(src, dtype, device):
    model, _ = load_fp_model(str(src), "float32")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            set_weight(module, rtn(get_weight(module), Grid(4), 32).dequantize())
    return model.to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_match_fake_quant(checkpoint, device):
    src, out = checkpoint
    dtype = torch.float32 if device == "cpu" else torch.float16
    model = load_quantized(out, device=device, dtype=dtype)
    assert next(model.buffers()).device.type == device
    prompt = torch.tensor([[1, 17, 42, 99, 7]], device=device)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, **kwargs)
    want = fake_quant(src, dtype, device).generate(prompt, **kwargs)
    assert got.shape == (1, 17)
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def codebook_checkpoint(model_factory, tmp_path_factory):
    """TurboQuant w4: rotated codebook layers (DecodedLinear, the codebook and rotation custom ops)."""
    out = tmp_path_factory.mktemp("gen") / "tq"
    quantize(str(model_factory("llama-gqa")), out, QuantConfig(method="turboquant", bits=4, group_size=32), device="cpu")
    return None, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["checkpoint", "codebook_checkpoint"])
def test_static_cache_decode_gives_the_same_tokens(which, device, request):
    """The one line that gets CUDA-graph decoding: generate(..., cache_implementation="static") (transformers
    compiles the decode step on a GPU; the layers' custom ops let it capture the whole step, and their split-K
    workspace is reserved before the capture: the first GPU run of an int4 model failed there)."""
    _, out = request.getfixturevalue(which)
    dtype = torch.float32 if device == "cpu" else torch.float16
    model = load_quantized(out, device=device, dtype=dtype)
    prompt = torch.tensor([[1, 17, 42, 99, 7], [3, 5, 8, 13, 21]], device=device)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    dynamic = model.generate(prompt, **kwargs)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert static.shape == (2, 17) and torch.equal(static, dynamic)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_model_on_the_second_gpu_generates_while_the_first_is_current(checkpoint):
    """Triton launches on the current device: without quantkit.kernels.device's guard a layer on cuda:1 fails
    while cuda:0 is current (the default in a process that did not choose)."""
    src, out = checkpoint
    assert torch.cuda.current_device() == 0
    model = load_quantized(out, device_map="cuda:1", dtype=torch.float16)
    prompt = torch.tensor([[1, 17, 42, 99, 7]], device="cuda:1")
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), fake_quant(src, torch.float16, "cuda:1").generate(prompt, **kwargs))


def test_blocks_are_assigned_in_order_in_equal_shares_within_budgets():
    from quantkit.core.errors import QuantkitError
    from quantkit.models.placement import assign_blocks

    assert assign_blocks(0, [10] * 8, [100, 100]) == [0] * 4 + [1] * 4
    assert assign_blocks(20, [10] * 8, [100, 100]) == [0] * 3 + [1] * 5  # the embeddings count on GPU 0
    assert assign_blocks(0, [10] * 9, [30, 100, 100]) == [0] * 3 + [1] * 3 + [2] * 3
    assert assign_blocks(0, [10] * 6, [25, 100]) == [0] * 2 + [1] * 4  # GPU 0 full before its share
    with pytest.raises(QuantkitError, match="stream=True"):
        assign_blocks(0, [10] * 8, [30, 30])
    with pytest.raises(QuantkitError, match="block 2 needs"):
        assign_blocks(0, [10, 10, 45], [40, 40])


def test_a_model_spread_over_devices_generates_the_same_tokens(checkpoint):
    """The placement path (outside modules, block map, accelerate's hooks, the KV cache left alone) on two CPU
    'devices': the hooks run as they would between GPUs, and the tokens do not change."""
    from quantkit.models.placement import outside_modules, spread

    _, out = checkpoint
    prompt = torch.tensor([[1, 17, 42, 99, 7]])
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = load_quantized(out, device="cpu").generate(prompt, **kwargs)
    model = load_quantized(out, device="cpu")
    outside = {"model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"}
    assert set(outside_modules(model, "model.layers")) == outside
    model = spread(model, "model.layers", ["cpu", "cpu"], [1 << 40, 1 << 40])
    assert set(model.hf_device_map) == outside | {"model.layers.0", "model.layers.1"}
    assert hasattr(model.model.layers[1], "_hf_hook")
    assert torch.equal(model.generate(prompt, **kwargs), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_balanced_loading_spreads_the_blocks_over_the_gpus(checkpoint):
    src, out = checkpoint
    model = load_quantized(out, device_map="balanced", dtype=torch.float16)
    assert set(model.hf_device_map.values()) == {"cuda:0", "cuda:1"}
    prompt = torch.tensor([[1, 17, 42, 99, 7]], device="cuda:0")
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), fake_quant(src, torch.float16, "cuda:0").generate(prompt, **kwargs))

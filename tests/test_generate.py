"""load_quantized models generate: same greedy tokens as the fake-quant reference (CPU; CUDA when present)."""
import pytest
import torch

from quantkit.api import quantize
from quantkit.config import QuantConfig
from quantkit.loading import load_quantized
from quantkit.model.loader import load_fp_model
from quantkit.model.sequential import get_weight, set_weight
from quantkit.methods.grid import Grid
from quantkit.methods.rtn import rtn

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
    model = load_quantized(out, device_map="auto" if device == "cuda" else None, dtype=dtype)
    assert next(model.buffers()).device.type == device
    prompt = torch.tensor([[1, 17, 42, 99, 7]], device=device)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, **kwargs)
    want = fake_quant(src, dtype, device).generate(prompt, **kwargs)
    assert got.shape == (1, 17)
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_static_cache_decode_gives_the_same_tokens(checkpoint, device):
    """The one line that gets CUDA-graph decoding: generate(..., cache_implementation="static") (transformers
    compiles the decode step on a GPU; QuantLinear's custom op lets it capture the whole step)."""
    _, out = checkpoint
    dtype = torch.float32 if device == "cpu" else torch.float16
    model = load_quantized(out, device_map="auto" if device == "cuda" else None, dtype=dtype)
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

"""torch.ops.quantkit.gptq_linear: a well-formed custom op, so torch.compile and CUDA graphs see
QuantLinear as one opaque call (no graph breaks inside the dispatch / launch Python code).

On CPU the op runs the torch reference; the GPU runs it through the Triton kernels (test_kernels.py).
"""
import pytest
import torch
from torch import nn

from quantkit.core import bitpack
from quantkit.kernels.reference import gptq_linear_torch
from quantkit.nn.quant_linear import QuantLinear


def quant_linear(k, n, bits, group_size, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    mod = QuantLinear(k, n, bits, group_size, bias=bias)
    mod.qweight.copy_(bitpack.pack(torch.randint(0, 2**bits, (k, n), generator=gen), bits, dim=0))
    mod.qzeros.copy_(bitpack.pack(torch.randint(0, 2**bits - 1, (groups, n), generator=gen), bits, dim=1))
    mod.scales.copy_(torch.rand(groups, n, generator=gen) * 0.02 + 0.002)
    mod.g_idx.copy_(torch.arange(k) // group_size)
    if bias:
        mod.bias.copy_(torch.randn(n, generator=gen))
    return mod


def op_args(mod, x):
    return (x, mod.qweight, mod.qzeros, mod.scales, mod.g_idx, mod.bits, mod.in_features, mod.bias, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,bias", [(4, True), (3, False)])
def test_op_is_well_formed_and_matches_reference(dtype, bits, bias):
    mod = quant_linear(72, 40, bits, 32, bias)
    x = torch.randn(2, 5, 72).to(dtype)
    y = torch.ops.quantkit.gptq_linear(*op_args(mod, x))
    assert y.shape == (2, 5, 40) and y.dtype == dtype
    assert torch.equal(y, gptq_linear_torch(*op_args(mod, x)))
    # Schema, fake (meta) implementation, and tracing through AOT autograd with dynamic shapes.
    torch.library.opcheck(torch.ops.quantkit.gptq_linear.default, op_args(mod, x))


def test_quantized_block_compiles_without_graph_breaks():
    """fullgraph=True fails on any graph break: the op must hide the dispatch and launch code, and
    QuantLinear must leave its (eager-only) CPU weight cache alone while compiling."""
    torch.manual_seed(0)
    block = nn.Sequential(quant_linear(64, 96, 4, 32, bias=True), nn.SiLU(), quant_linear(96, 64, 4, 32, bias=False))
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (1, 7):  # decode and prefill shapes through the same graph
        x = torch.randn(m, 64)
        torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-6)


def test_loaded_quantized_model_compiles_in_one_graph(tmp_path):
    import quantkit
    from quantkit.run.config import QuantConfig
    from tiny_models import make_model_folder

    quantkit.quantize(str(make_model_folder("llama-gqa", tmp_path)), str(tmp_path / "q"),
                      QuantConfig(method="rtn", bits=4, group_size=32))
    model = quantkit.load_quantized(str(tmp_path / "q"), device="cpu")
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(ids, use_cache=False)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                   rtol=1e-5, atol=1e-5)

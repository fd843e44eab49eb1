"""The block runner's observation pass: it stops each sample's forward once the stage's linears have their
inputs, and linears fed one tensor share one Hessian — without changing any statistic."""
import torch

from quantkit.methods.gptq import GPTQ
from quantkit.model.sequential import _observe_stage, input_hooks
from test_awq import _block_runner, tiny_model

QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]


def _calls(block, names):
    """Counts of forward calls of the named modules while the context is active."""
    counts = {n: 0 for n in names}
    return counts, input_hooks(block, names, lambda n, x: counts.__setitem__(n, counts[n] + 1))


def test_observe_stops_after_the_stage_and_names_the_shared_input():
    model = tiny_model("llama-gqa")
    _, block, runner = _block_runner(model, n=3)
    later = ["self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]
    counts, hooks = _calls(block, later)
    sources = []
    with hooks:
        runner.observe(QKV, lambda n, x, source: sources.append((n, source)))
    assert counts == {n: 0 for n in later}  # nothing after v_proj's input was computed
    assert sources == [(n, "self_attn.q_proj") for n in QKV] * 3

    seen = []
    runner.observe(["self_attn.o_proj", "mlp.up_proj"], lambda n, x, source: seen.append((n, source)))
    assert seen == [("self_attn.o_proj", "self_attn.o_proj"), ("mlp.up_proj", "mlp.up_proj")] * 3


def test_shared_hessians_equal_separately_accumulated_ones():
    model = tiny_model("llama-gqa")
    _, block, runner = _block_runner(model, n=3)
    names = QKV + ["self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    observers = {n: GPTQ(block.get_submodule(n).weight) for n in names}
    _observe_stage(runner, names, observers)

    separate = {n: GPTQ(block.get_submodule(n).weight) for n in names}
    with input_hooks(block, names, lambda n, x: separate[n].add_batch(x)):
        runner.forward_all()
    for n in names:
        assert torch.equal(observers[n].H, separate[n].H), n
        assert observers[n].nsamples == separate[n].nsamples
    assert observers["self_attn.v_proj"].H is observers["self_attn.q_proj"].H
    assert observers["mlp.up_proj"].H is observers["mlp.gate_proj"].H
    # o_proj reads the attention output, not the normed input: its own statistics
    assert observers["self_attn.o_proj"].H is not observers["self_attn.q_proj"].H

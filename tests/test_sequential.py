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


def test_a_parallel_stage_never_computes_its_own_linears_and_sees_the_same_inputs():
    model = tiny_model("llama-gqa")
    _, block, runner = _block_runner(model, n=3)
    stage = ["mlp.gate_proj", "mlp.up_proj"]
    computed = []
    handles = [block.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: computed.append(n) if out.any()
                                                            else None) for n in stage]  # zeros: not computed
    plain, skipped = [], []
    runner.observe(stage, lambda n, x, source: plain.append(x.clone()))
    assert computed == ["mlp.gate_proj"] * 3  # without parallel, gate_proj ran before up_proj's input was reached
    computed.clear()
    runner.observe(stage, lambda n, x, source: skipped.append(x.clone()), parallel=True)
    assert computed == []
    assert all(torch.equal(a, b) for a, b in zip(plain, skipped)) and len(plain) == len(skipped) == 6
    for h in handles:
        h.remove()
    assert "forward" not in vars(block.get_submodule("mlp.gate_proj"))  # the class's forward is back

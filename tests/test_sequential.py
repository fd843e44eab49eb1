"""The block runner's observation pass: it stops each sample's forward once the stage's linears have their
inputs, linears fed one tensor share one Hessian, and final attention and MLP work is replayed, not recomputed — without
changing any statistic."""
import dataclasses

import pytest
import torch

from quantkit.run.config import QuantConfig
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.method import Method
from quantkit.models.arch import arch_for, block_linears, get_submodule
from quantkit.calibration.replay import ReplayedOutputs
from quantkit.calibration.runner import input_hooks, observe_stage
from tiny_models import run_sequential
from test_awq import _block_runner, ids, tiny_model

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
    observe_stage(runner, names, observers)

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


def _quantized_weights(model, arch, input_ids, config):
    results = run_sequential(model, arch, input_ids, Method(config, arch), "cpu")
    return {name: res.dequantize() for name, res in results.items()}


def _computed_calls(model, arch, linear):
    """Per call of block 0's `linear`, whether it really computed (zeros: a stage's stand-in)."""
    calls = []
    module = get_submodule(model, arch.blocks)[0].get_submodule(linear)
    module.register_forward_hook(lambda m, a, out: calls.append(bool(out.any())))
    return calls


def _norm_runs(model, arch):
    """Per module of block 0's Arch.feeds_only: a list growing by one per call that really computed (a skipped one
    passes its input on)."""
    block = get_submodule(model, arch.blocks)[0]
    runs = {}
    for name, _ in arch.feeds_only:
        runs[name] = []
        block.get_submodule(name).register_forward_hook(lambda m, a, out, n=name: runs[n].append(out is not a[0]))
    return runs


def _other_family(kind):
    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, Phi3Config, PhiConfig

    torch.manual_seed(0)
    small = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=128)
    config = {"gpt2": lambda: GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128),
              "gpt_neox": lambda: GPTNeoXConfig(**small),
              "phi": lambda: PhiConfig(**small),
              "phi3": lambda: Phi3Config(**small, pad_token_id=0)}[kind]()
    return AutoModelForCausalLM.from_config(config).float().eval()


# Per family: how often block 0's attention input projection and MLP input projection really compute (3 samples),
# with replays and without. Replayed: the attention runs in the o pass and for the first sample of the gate/up
# pass (which learns how it wraps o_proj's result), the MLP's gate/up in the down pass and the final forward's
# first sample. OPT's fc1/fc2 sit in the block itself (no MLP to replay); phi's parallel block has two stages.
_COMPUTED = {"llama-gqa": ((4, 4), (12, 6)), "qwen2": ((4, 4), (12, 6)), "opt": ((4, 6), (12, 6)),
             "gpt2": ((4, 4), (12, 6)), "gpt_neox": ((4, 4), (12, 6)), "phi3": ((4, 4), (12, 6)),
             "phi": ((4, 4), (6, 6))}


@pytest.mark.parametrize("kind", list(_COMPUTED))
def test_replays_give_the_same_quantized_model_and_skip_the_recomputation(kind):
    """The attention's and the MLP's work, recorded once final (their output linear's input, then their output) and
    replayed in the later passes, makes bit-identical weights to recomputing it in every pass, and the recomputing
    really stops (the projections feeding them run once per sample, plus the first sample of the first replay; the
    norms before them, Arch.feeds_only, only where the replayed submodule reads them)."""
    config = QuantConfig(method="gptq", bits=3, group_size=32)
    runs, norms = {}, {}
    for reuse in (True, False):
        model = tiny_model(kind) if kind in ("llama-gqa", "opt", "qwen2") else _other_family(kind)
        arch = arch_for(model) if reuse else dataclasses.replace(arch_for(model), reusable=())
        attention = _computed_calls(model, arch, arch.sequential[0][0])
        mlp = _computed_calls(model, arch, arch.sequential[0][-1] if kind == "phi" else arch.sequential[2][0])
        norms[reuse] = _norm_runs(model, arch)
        runs[reuse] = _quantized_weights(model, arch, ids(3), config), (attention.count(True), mlp.count(True))
    (replayed, computed), (recomputed, computed_without) = runs[True], runs[False]
    assert replayed.keys() == recomputed.keys() and len(replayed) == 2 * len(block_linears(arch_for(model)))
    for name in replayed:
        assert torch.equal(replayed[name], recomputed[name]), name
    assert (computed, computed_without) == _COMPUTED[kind]
    # 3 samples: the attention's norm in the q/k/v and o passes and for the first gate/up sample, the MLP's in the
    # gate/up and down passes and for the final forward's first sample; without replays in every pass they reach
    assert {n: (r.count(True), all(norms[False][n])) for n, r in norms[True].items()} == (
        {} if kind in ("opt", "phi") else dict(zip([n for n, _ in arch_for(model).feeds_only], [(7, True), (7, True)])))


def test_a_replayed_output_is_copied_for_later_passes_and_handed_to_the_final_forward():
    model = tiny_model("llama-gqa")
    _, block, runner = _block_runner(model, n=2)
    reference = runner.forward_all(keep_outputs=True)
    runner.replayed.final("self_attn")
    runner.observe(["mlp.gate_proj"], lambda n, x, source: None)  # records the attention's output
    recorded = runner.replayed.outputs["self_attn"]
    assert sorted(recorded) == [0, 1]
    kept = recorded[0][0]
    first = kept.clone()
    with torch.no_grad():
        block.self_attn.o_proj.weight.mul_(2)  # a replay does not see it: the output was recorded
    returned, handle = _outputs_of(block.self_attn)
    runner.observe(["mlp.down_proj"], lambda n, x, source: None)  # a later pass: replays a copy (may be modified)
    assert [t.data_ptr() for t in returned] and all(t.data_ptr() != kept.data_ptr() for t in returned)
    returned.clear()
    replayed = runner.forward_all(keep_outputs=True)
    handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(reference, replayed))
    assert recorded == {} and torch.equal(kept, first)  # consumed, and never modified
    assert returned[0].data_ptr() == kept.data_ptr()  # the last reader gets the recording itself
    assert "forward" not in vars(block.self_attn)  # the class's forward is back
    changed = runner.forward_all(keep_outputs=True)  # nothing recorded any more: computed with the new weight
    assert not torch.equal(changed[0], reference[0])


def _outputs_of(module):
    """([first output tensor of each call], the hook's handle)."""
    returned = []
    return returned, module.register_forward_hook(lambda m, args, out: returned.append(out[0]))


def _recorded_tail(kind="llama-gqa", n=2):
    """A block runner whose MLP input to down_proj was recorded by an observing pass, then made final."""
    model = tiny_model(kind)
    _, block, runner = _block_runner(model, n=n)
    reference = runner.forward_all(keep_outputs=True)
    runner.replayed.record_tail("mlp", "mlp.down_proj")
    runner.observe(["mlp.down_proj"], lambda n, x, source: None, parallel=True)
    runner.replayed.final("mlp", record_outputs=False)
    return block, runner, reference


def _forward_counting(runner, block, linear):
    """The runner's final forward, and how often `linear` of the block was called in it."""
    counts, counting = _calls(block, [linear])
    with counting:
        outputs = runner.forward_all(keep_outputs=True)
    return outputs, counts[linear]


def test_a_replayed_tail_skips_the_submodule_and_is_consumed():
    """The MLP's output from its recorded down_proj input: gate/up not run for the replayed samples (the first
    runs for real, to learn the output's shape), the block's outputs unchanged, the recordings dropped."""
    block, runner, reference = _recorded_tail(n=3)
    recorded = runner.replayed.recorded["mlp"].tail_inputs
    assert sorted(recorded) == [0, 1, 2]
    replayed, gate_calls = _forward_counting(runner, block, "mlp.gate_proj")
    assert all(torch.equal(a, b) for a, b in zip(reference, replayed))
    assert gate_calls == 1 and recorded == {}
    assert "forward" not in vars(block.mlp)  # the class's forward is back


def test_a_tail_is_replayed_through_the_output_linear_as_it_is_now():
    """The recorded input goes through down_proj as quantized after the recording: the same outputs as the whole
    MLP recomputed with the new weight."""
    block, runner, _ = _recorded_tail(n=3)
    with torch.no_grad():
        block.mlp.down_proj.weight.mul_(2)
    replayed = runner.forward_all(keep_outputs=True)
    recomputed = runner.forward_all(keep_outputs=True)  # nothing recorded any more
    assert all(torch.equal(a, b) for a, b in zip(replayed, recomputed))


def test_a_tail_input_is_kept_as_fed_only_where_the_pass_stops_at_it_and_it_owns_its_memory():
    """Nothing computes on the input that ends a pass, so it is recorded without a copy; an input the pass goes
    on from, or a view into a larger buffer (which it would keep alive), is copied."""
    _, block, runner = _block_runner(tiny_model("llama-gqa"), n=2)
    runner.replayed.record_tail("mlp", "mlp.down_proj")
    fed = []
    runner.observe(["mlp.down_proj"], lambda n, x, source: fed.append(x), parallel=True)
    recorded = runner.replayed.recorded["mlp"].tail_inputs
    assert [recorded[i] is x for i, x in enumerate(fed)] == [True, True]

    replayed = ReplayedOutputs(block, "cpu", "cpu", n_samples=3)
    replayed.record_tail("mlp", "mlp.down_proj")
    buffer = torch.randn(4, block.mlp.down_proj.in_features)
    for i, (x, last) in enumerate([(buffer[:2], True), (buffer.clone(), False), (buffer.clone(), True)]):
        replayed.sample = i
        replayed.fed("mlp.down_proj", x, last)
        assert torch.equal(replayed.recorded["mlp"].tail_inputs[i], x)
        assert (replayed.recorded["mlp"].tail_inputs[i] is x) == (i == 2)


def test_a_tail_not_fitting_in_memory_is_not_recorded(monkeypatch):
    import quantkit.calibration.replay as replay

    monkeypatch.setattr(replay, "free_bytes", lambda device: 0)
    block, runner, reference = _recorded_tail()
    assert runner.replayed.recorded["mlp"].tail_inputs == {} and not runner.replayed.recorded["mlp"].tail_final
    outputs, gate_calls = _forward_counting(runner, block, "mlp.gate_proj")
    assert all(torch.equal(a, b) for a, b in zip(reference, outputs))
    assert gate_calls == 2  # computed for every sample


def test_a_submodule_that_transforms_its_tail_output_is_computed(monkeypatch):
    """A submodule whose output is not its output linear's result as is (here doubled) cannot be rebuilt from
    that result: seen on the first sample, then computed as before, with the same outputs."""
    mlp_class = type(get_submodule(tiny_model("llama-gqa"), "model.layers.0.mlp"))
    forward = mlp_class.forward
    monkeypatch.setattr(mlp_class, "forward", lambda self, x: 2 * forward(self, x))
    block, runner, reference = _recorded_tail(n=3)
    outputs, gate_calls = _forward_counting(runner, block, "mlp.gate_proj")
    assert all(torch.equal(a, b) for a, b in zip(reference, outputs))
    assert gate_calls == 3 and runner.replayed.recorded["mlp"].tail_inputs == {}

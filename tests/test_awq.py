"""AWQ: scale search, folding, clip search, and the per-block driver on tiny random models (CPU, fp32)."""
import dataclasses

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GemmaConfig, GraniteConfig, LlamaConfig,
                          MixtralConfig, OPTConfig, Qwen2Config, Starcoder2Config)

from quantkit.run.config import QuantConfig
from quantkit.core.errors import QuantkitError
from quantkit.algorithms import awq, awq_block
from quantkit.schemes.grid import Grid
from quantkit.algorithms.rtn import rtn
from quantkit.models.arch import ARCHS, Arch, arch_for, get_submodule, require_scale_groups
from quantkit.calibration.runner import BlockRunner
from quantkit.calibration.capture import capture_block_calls
from quantkit.calibration.sequential import get_weight

VOCAB = 512


def _llama(kv_heads):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128)


MHA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, max_position_embeddings=128)
CONFIGS = {
    "llama-gqa": lambda: _llama(2),
    "llama-mha": lambda: _llama(4),
    "qwen2": lambda: Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "opt": lambda: OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                             num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=128),
    "gemma": lambda: GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                 max_position_embeddings=128),
    "gemma2": lambda: Gemma2Config(**MHA, head_dim=16),
    "gemma3_text": lambda: Gemma3TextConfig(**MHA, head_dim=16),
    "granite": lambda: GraniteConfig(**MHA),
    "starcoder2": lambda: Starcoder2Config(**MHA),
    "mixtral": lambda: MixtralConfig(**MHA, num_local_experts=4),  # the attention only: the norm feeds the router
}


def tiny_model(name, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = CONFIGS[name]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    # random norms (weights and biases) so folding into them is really exercised
    offset = 1.0 if name.startswith("gemma") else 0.0
    with torch.no_grad():
        for mod in model.modules():
            w = getattr(mod, "weight", None)
            if "Norm" in type(mod).__name__ and isinstance(w, torch.Tensor):
                w.copy_(torch.empty_like(w).uniform_(0.5, 1.5) - offset)
                if isinstance(getattr(mod, "bias", None), torch.Tensor):
                    mod.bias.copy_(0.1 * torch.randn_like(mod.bias))
    return model


def ids(n=4, length=32, seed=1):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------- folding

@pytest.mark.parametrize("name", list(CONFIGS))
def test_fold_random_scales_keeps_logits(name):
    model = tiny_model(name)
    arch = arch_for(model)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    gen = torch.Generator().manual_seed(2)
    folded, skipped = [], []
    for block in get_submodule(model, arch.blocks):
        for prev, names in arch.scale_groups:
            prev_op, mods = block.get_submodule(prev), [block.get_submodule(n) for n in names]
            s = torch.exp(0.5 * torch.randn(get_weight(mods[0]).shape[1], generator=gen))
            reason = awq.fold_scales(prev_op, mods, s, arch.norm_offset)
            (skipped if reason else folded).append((prev, reason))
    with torch.no_grad():
        out = model(x).logits
    assert rel(out, ref) <= 1e-4
    n_groups = len(arch.scale_groups) * 2
    if name in ("llama-gqa", "qwen2"):  # v -> o cannot fold under grouped-query attention
        assert len(folded) == n_groups - 2
        assert all(p == "self_attn.v_proj" and "grouped-query" in r for p, r in skipped)
    else:
        assert len(folded) == n_groups and not skipped


def test_fold_really_changes_weights_and_needs_the_offset():
    """Gemma's (1 + w) norm: folding without the offset would change the function."""
    model = tiny_model("gemma")
    block = model.model.layers[0]
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    s = torch.exp(0.5 * torch.randn(64, generator=torch.Generator().manual_seed(3)))
    awq.fold_scales(block.input_layernorm, [block.self_attn.q_proj, block.self_attn.k_proj,
                                           block.self_attn.v_proj], s, norm_offset=0.0)   # wrong offset
    with torch.no_grad():
        assert rel(model(x).logits, ref) > 1e-2


def test_fold_reason_for_unfoldable_shapes():
    v, o = torch.nn.Linear(64, 32), torch.nn.Linear(64, 64)   # GQA: v out 32 != o in 64
    w_before = o.weight.clone()
    reason = awq.fold_scales(v, [o], torch.full((64,), 2.0))
    assert reason and "grouped-query" in reason
    assert torch.equal(o.weight, w_before)
    assert "no weight" in awq.fold_reason(torch.nn.ReLU(), [o])
    assert "not linear" in awq.fold_reason(torch.nn.LayerNorm(64), [torch.nn.ReLU()])


# ------------------------------------------------------------------------- scale search

def _outlier_x(tokens, cols, gen, n_out=4, factor=50.0):
    x = torch.randn(tokens, cols, generator=gen)
    x[:, :n_out] *= factor
    return x


@pytest.mark.parametrize("bits,group_size", [(4, 32), (3, 32), (4, -1)])
def test_search_alpha_zero_without_outliers_positive_with(bits, group_size):
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        w = 0.02 * torch.randn(96, 128, generator=gen)
        _, alpha, errors = awq.search_scales([w], torch.randn(1024, 128, generator=gen), Grid(bits), group_size)
        assert alpha == 0.0 and len(errors) == 20
        s, alpha, errors = awq.search_scales([w], _outlier_x(1024, 128, gen), Grid(bits), group_size)
        assert alpha > 0 and min(errors) < 0.9 * errors[0]
        assert s[:4].min() > s[4:].max()          # the outlier channels get the largest scales


def test_fake_quant_matches_rtn():
    w = torch.randn(40, 70)
    for sym in (True, False):
        for gs in (32, -1, 16):
            assert torch.equal(awq.fake_quant(w, Grid(4, sym), gs), rtn(w, Grid(4, sym), gs).dequantize())


@pytest.mark.parametrize("bits,group_size", [(4, 32), (3, 32)])
def test_awq_beats_rtn_on_held_out_inputs(bits, group_size):
    gen = torch.Generator().manual_seed(0)
    w = 0.02 * torch.randn(128, 256, generator=gen)
    x_cal, x_test = _outlier_x(2048, 256, gen, n_out=8), _outlier_x(2048, 256, gen, n_out=8)
    grid = Grid(bits)
    s, alpha, _ = awq.search_scales([w], x_cal, grid, group_size)
    ref = x_test @ w.t()
    err_rtn = (x_test @ awq.fake_quant(w, grid, group_size).t() - ref).pow(2).mean()
    err_awq = ((x_test / s) @ awq.fake_quant(w * s, grid, group_size).t() - ref).pow(2).mean()
    assert alpha > 0
    assert err_awq < 0.8 * err_rtn, (alpha, (err_awq / err_rtn).item())


# ------------------------------------------------------------------------- clipping

@pytest.mark.parametrize("sym", [True, False])
def test_clip_never_increases_group_error(sym):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=gen)
    w[:, 5] *= 8                                  # a few large weights make clipping attractive
    x = torch.randn(600, 80, generator=gen)
    grid, gs = Grid(3, sym), 32                   # 80 = 32 + 32 + 16: a short last group
    bounds, e0, e1 = awq.clip_search(w, x, grid, gs, return_errors=True)
    assert bounds.shape == (48, 3, 2)
    assert (e1 <= e0).all() and (e1 < e0).any()
    # recompute independently: per-group partial outputs on the same token subsample
    xs = awq.subsample(x, awq.CLIP_TOKENS)
    g = torch.arange(80) // gs

    def group_err(wq):
        d = xs[:, None, :] * (wq - w)[None]       # [tokens, rows, in]
        return torch.stack([d[..., g == i].sum(-1).pow(2).mean(0) for i in range(3)], dim=1)

    plain = group_err(awq.fake_quant(w, grid, gs))
    clipped = group_err(awq.fake_quant(w, grid, gs, bounds))
    assert torch.allclose(plain, e0, rtol=1e-4, atol=1e-6) and torch.allclose(clipped, e1, rtol=1e-4, atol=1e-6)
    assert (clipped <= plain * (1 + 1e-5)).all()
    # apply_clip clamps into the bounds, and quantizing the clamped weight is the same thing
    lin = torch.nn.Linear(80, 48, bias=False)
    lin.weight.data.copy_(w)
    awq.apply_clip(lin, bounds, gs)
    assert (lin.weight <= bounds[:, g, 1] + 1e-6).all() and (lin.weight >= bounds[:, g, 0] - 1e-6).all()
    assert torch.allclose(awq.fake_quant(lin.weight, grid, gs), awq.fake_quant(w, grid, gs, bounds), atol=1e-6)


def test_no_clip_names():
    for n in ("self_attn.q_proj", "self_attn.k_proj", "attention.query_key_value", "attn.c_attn",
              "self_attn.qkv_proj"):
        assert awq.no_clip(n)
    for n in ("self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj", "fc1", "self_attn.out_proj"):
        assert not awq.no_clip(n)


# ------------------------------------------------------------------------- the block driver

def _block_runner(model, layer=0, n=4, length=32):
    arch = arch_for(model)
    captured = capture_block_calls(model, arch, ids(n, length), "cpu")
    block = get_submodule(model, arch.blocks)[layer]
    return arch, block, BlockRunner(block, captured.inputs, captured.of_block(layer), "cpu")


def _outlier_embeddings(model, factor=30.0):
    with torch.no_grad():
        model.get_input_embeddings().weight[:, :4] *= factor


def _snapshot(block):
    return {k: v.clone() for k, v in block.state_dict().items()}


def test_prepare_block_keeps_fp_output_without_clip():
    model = tiny_model("llama-mha")
    _outlier_embeddings(model)
    arch, block, runner = _block_runner(model)
    ref = torch.cat(runner.forward_all(keep_outputs=True))
    before = _snapshot(block)
    report = awq_block.awq_prepare_block(runner, block, "model.layers.0", arch,
                                   QuantConfig(method="awq", bits=4, group_size=32, awq_clip=False))
    out = torch.cat(runner.forward_all(keep_outputs=True))
    assert rel(out, ref) <= 1e-4
    assert set(report) == {f"{p}->{','.join(ns)}" for p, ns in arch.scale_groups}
    assert all(e["skipped"] is None for e in report.values())
    assert all(e["error_awq"] <= e["error_rtn"] for e in report.values())
    assert any(e["alpha"] > 0 for e in report.values())
    assert not torch.equal(before["input_layernorm.weight"], block.input_layernorm.weight)


def test_prepare_block_with_clip_lowers_quantized_block_error():
    """AWQ scales + clip, then RTN, against plain RTN: the quantized block's output error drops."""
    cfg = QuantConfig(method="awq", bits=3, group_size=32)

    def quantized_block_error(prepare):
        model = tiny_model("llama-mha")
        _outlier_embeddings(model)
        arch, block, runner = _block_runner(model)
        ref = torch.cat(runner.forward_all(keep_outputs=True))
        report = awq_block.awq_prepare_block(runner, block, "model.layers.0", arch, cfg) if prepare else {}
        for n in (n for stage in arch.sequential for n in stage):
            lin = block.get_submodule(n)
            lin.weight.data.copy_(rtn(lin.weight.data, Grid(cfg.bits, cfg.sym), cfg.group_size).dequantize())
        return rel(torch.cat(runner.forward_all(keep_outputs=True)), ref), report

    err_rtn, _ = quantized_block_error(False)
    err_awq, report = quantized_block_error(True)
    assert err_awq < err_rtn, (err_awq, err_rtn)
    clipped = {n for e in report.values() for n in e["clip"]}
    assert clipped == {"self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    for e in report.values():
        for c in e["clip"].values():
            assert c["error_clip"] <= c["error_noclip"] and 0.5 < c["mean_ratio"] <= 1


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_prepare_block_skips_v_o_under_gqa(name):
    model = tiny_model(name)
    _outlier_embeddings(model)
    arch, block, runner = _block_runner(model)
    o_before = block.self_attn.o_proj.weight.clone()
    ref = torch.cat(runner.forward_all(keep_outputs=True))
    report = awq_block.awq_prepare_block(runner, block, "model.layers.0", arch,
                                   QuantConfig(method="awq", bits=4, group_size=32, awq_clip=False))
    entry = report["self_attn.v_proj->self_attn.o_proj"]
    assert "grouped-query" in entry["skipped"] and entry["alpha"] is None
    assert torch.equal(block.self_attn.o_proj.weight, o_before)
    assert rel(torch.cat(runner.forward_all(keep_outputs=True)), ref) <= 1e-4
    assert sum(e["skipped"] is None for e in report.values()) == 3


def test_prepare_block_skips_groups_that_do_not_fold_post_ln_opt():
    """OPT-350m style (do_layer_norm_before=False): the table's norms do not feed the linears."""
    model = tiny_model("opt", do_layer_norm_before=False)
    _outlier_embeddings(model)
    arch, block, runner = _block_runner(model)
    ref = torch.cat(runner.forward_all(keep_outputs=True))
    report = awq_block.awq_prepare_block(runner, block, "model.decoder.layers.0", arch,
                                   QuantConfig(method="awq", bits=4, group_size=32, awq_clip=False))
    for label in ("self_attn_layer_norm->self_attn.q_proj,self_attn.k_proj,self_attn.v_proj", "final_layer_norm->fc1"):
        assert "changes the block output" in report[label]["skipped"]
    assert report["fc1->fc2"]["skipped"] is None
    assert rel(torch.cat(runner.forward_all(keep_outputs=True)), ref) <= 1e-4


@pytest.mark.parametrize("name,prefix", [("opt", "model.decoder.layers.0"), ("gemma", "model.layers.0")])
def test_prepare_block_other_families(name, prefix):
    model = tiny_model(name)
    _outlier_embeddings(model)
    arch, block, runner = _block_runner(model)
    ref = torch.cat(runner.forward_all(keep_outputs=True))
    report = awq_block.awq_prepare_block(runner, block, prefix, arch,
                                   QuantConfig(method="awq", bits=4, group_size=32, awq_clip=False))
    assert all(e["skipped"] is None for e in report.values()), report
    assert rel(torch.cat(runner.forward_all(keep_outputs=True)), ref) <= 1e-4


def test_prepare_block_respects_config_skips():
    model = tiny_model("llama-mha")
    arch, block, runner = _block_runner(model)
    cfg = QuantConfig(method="awq", bits=4, group_size=32, modules=[{"pattern": r"\.mlp\.", "skip": True}])
    before = _snapshot(block)
    report = awq_block.awq_prepare_block(runner, block, "model.layers.0", arch, cfg)
    for label in ("post_attention_layernorm->mlp.gate_proj,mlp.up_proj", "mlp.up_proj->mlp.down_proj"):
        assert report[label]["skipped"] == "all linears skipped by the config"
    for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"):
        assert torch.equal(before[k], block.state_dict()[k])


def test_unknown_family_needs_scale_groups():
    model = tiny_model("llama-mha")
    model.config.model_type = "made_up"
    arch = dataclasses.replace(ARCHS["llama"], scale_groups=())
    with pytest.raises(QuantkitError, match="scale-group table"):
        require_scale_groups(arch, model.config.model_type)
    _, block, runner = _block_runner(model)
    with pytest.raises(QuantkitError, match="scale-group table"):
        awq_block.awq_prepare_block(runner, block, "model.layers.0", arch, QuantConfig(method="awq"))
    assert isinstance(arch_for(model), Arch) and arch_for(model).scale_groups == ()


# ------------------------------------------------------------------------- what the searches read

def test_search_samples_are_evenly_spaced_and_hold_the_search_tokens(monkeypatch):
    inputs = [torch.zeros(1, 32, 8)] * 10
    monkeypatch.setattr(awq_block, "SEARCH_TOKENS", 100)  # 4 samples of 32 tokens hold 100
    assert awq_block.search_samples(inputs) == [0, 3, 6, 9]
    monkeypatch.setattr(awq_block, "SEARCH_TOKENS", 4096)  # more than there are: every sample
    assert awq_block.search_samples(inputs) == list(range(10))


def _awq_checkpoint(tmp_path, name, calib, **settings):
    """(model.safetensors bytes, {layer: relative output error in the report}) of an AWQ run on stories260k."""
    from quantkit.api import quantize
    from quantkit.demo import bundled_model_path

    config = QuantConfig(method="awq", bits=4, group_size=32, nsamples=calib.shape[0], seqlen=calib.shape[1],
                         **settings)
    report = quantize(str(bundled_model_path()), tmp_path / name, config, device="cpu", calibration_ids=calib)
    errors = {layer: entry["error"] for layer, entry in report["layers"].items()}
    return (tmp_path / name / "model.safetensors").read_bytes(), errors


def test_awq_reads_only_the_search_samples(tmp_path, monkeypatch):
    """AWQ's choices come from the search samples alone: other samples changed, the checkpoint is the same byte
    for byte (its RTN rounding ignores the data; they feed only the error report), a search sample changed, it is
    not (so the first comparison means something)."""
    monkeypatch.setattr(awq_block, "SEARCH_TOKENS", 128)  # 2 of the 6 samples of 64 tokens: 0 and 5
    calib = torch.randint(0, 512, (6, 64), generator=torch.Generator().manual_seed(3))
    other = torch.randint(0, 512, (6, 64), generator=torch.Generator().manual_seed(4))
    base, _ = _awq_checkpoint(tmp_path, "base", calib)
    others_changed = torch.cat([calib[:1], other[1:5], calib[5:]])
    assert _awq_checkpoint(tmp_path, "others", others_changed)[0] == base
    assert _awq_checkpoint(tmp_path, "searched", torch.cat([other[:1], calib[1:]]))[0] != base


def test_awq_stages_change_only_the_report(tmp_path):
    """AWQ rounds to nearest, so calibrating stage by stage (the default: with the replays it costs one block
    forward in all, one pass and a final forward cost two) or in one pass gives the same checkpoint. The error
    report differs where a layer's inputs come after quantized stages (o_proj, down_proj, every later block):
    staged, it sees what the layer will really get."""
    calib = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(3))
    staged, staged_errors = _awq_checkpoint(tmp_path, "staged", calib)
    one_pass, one_pass_errors = _awq_checkpoint(tmp_path, "one-pass", calib, true_sequential=False)
    assert one_pass == staged
    first_stage = [n for n in staged_errors if n.startswith("model.layers.0.self_attn.") and "o_proj" not in n]
    assert first_stage and all(staged_errors[n] == one_pass_errors[n] for n in first_stage)
    assert staged_errors["model.layers.0.mlp.down_proj"] != one_pass_errors["model.layers.0.mlp.down_proj"]

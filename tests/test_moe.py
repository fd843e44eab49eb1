"""Mixture-of-experts models: transformers 5's fused experts split into one linear per expert, each quantized from
the tokens routed to it, routers in float, and the checkpoint loading back with the in-loop logits."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantkit
from quantkit.checkpoint.files import read_tensors
from quantkit.demo import bundled_model_path
from quantkit.models.moe import ExpertLinears, set_all_tokens, split_experts
from test_quantizers import calibration, capture_results, in_loop_logits

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def gpt_oss(dead_expert=None):
    """gpt-oss: experts transposed, [gate, up] interleaved, with biases and a clamped SwiGLU; its router has a
    bias, which can keep an expert from ever being chosen."""
    from transformers import GptOssConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                          head_dim=16, rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 10000.0}))
    with torch.no_grad():
        for p in model.parameters():
            if not p.abs().sum():
                p.normal_(0, 0.02)  # from_config leaves the expert tensors at zero
        if dead_expert is not None:
            for layer in model.model.layers:
                layer.mlp.router.bias[dead_expert] = -1e4
    return model


def llama4():
    """Llama 4: a dense block, then a MoE block whose router scales each token before every expert sees it."""
    from transformers import Llama4TextConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Llama4TextConfig(
        **{**COMMON, "intermediate_size": 32}, intermediate_size_mlp=96, head_dim=16, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2))
    with torch.no_grad():
        for p in model.parameters():
            if not p.abs().sum():
                p.normal_(0, 0.02)
    return model.eval()


def saved(model, folder):
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    return folder


def moe_model(kind, model_factory):
    return {"gpt_oss": gpt_oss, "llama4": llama4}.get(
        kind, lambda: AutoModelForCausalLM.from_pretrained(model_factory("mixtral")))()


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss", "llama4"])
def test_split_experts_compute_what_the_fused_ones_do(model_factory, kind):
    model = moe_model(kind, model_factory)
    ids = calibration()
    with torch.no_grad():
        fused = model(ids).logits
        split_experts(model)
        split = model(ids).logits
    experts = model.model.layers[1].feed_forward.experts if kind == "llama4" else model.model.layers[0].mlp.experts
    assert isinstance(experts, ExpertLinears) and len(experts) == 4
    assert isinstance(experts[3].down_proj, torch.nn.Linear) and (experts[0].gate_proj.bias is not None) == \
        (kind == "gpt_oss")
    torch.testing.assert_close(split, fused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["mixtral", "llama4"])
def test_every_expert_on_every_token_keeps_the_routed_output(model_factory, kind):
    """--moe-calibration all: the experts compute every token, the block output sums the routed ones as before."""
    model = split_experts(moe_model(kind, model_factory))
    ids = calibration()
    with torch.no_grad():
        routed = model(ids).logits
        set_all_tokens(model, True)
        every = model(ids).logits
    torch.testing.assert_close(every, routed, rtol=1e-5, atol=1e-6)


def test_input_scaled_experts_see_their_routed_tokens_or_all_of_them():
    """Llama 4: an expert's linears read its routed tokens (scaled by the router score) or, with all_tokens, every
    token scaled by the sigmoid of its own router logit; the counts are the routed tokens either way."""
    model = split_experts(llama4())
    moe, ids = model.model.layers[1].feed_forward, calibration()[:1]
    seen = []
    moe.experts[2].gate_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    with torch.no_grad():
        for all_tokens in (False, True):
            moe.experts.routed_counts, hidden = torch.zeros(4, dtype=torch.long), []
            hook = moe.router.register_forward_hook(lambda m, args, out: hidden.append(out[1].argmax(-1)))
            set_all_tokens(model, all_tokens)
            model(ids)
            hook.remove()
            routed = torch.bincount(hidden[-1], minlength=4)
            assert moe.experts.routed_counts.tolist() == routed.tolist()
    assert seen == [int(routed[2]), ids.numel()] and 0 < routed[2] < ids.numel()


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_every_expert_is_quantized_and_loads_with_the_in_loop_logits(model_factory, tmp_path, monkeypatch, capsys,
                                                                     method):
    src, ids = model_factory("mixtral"), calibration()
    results = capture_results(monkeypatch)
    report = quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(method=method, group_size=32),
                               calibration_ids=ids)
    # read block by block from Mixtral's own file names (block_sparse_moe.experts.N.w1/w3/w2), not loaded whole
    assert "loaded whole" not in capsys.readouterr().err
    # and written under those names (what vLLM's mixtral.py reads); report and files agree
    experts = [f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}" for i in (0, 1) for e in range(4)
               for w in ("w1", "w3", "w2")]
    assert set(experts) <= set(report["layers"]) and len(report["layers"]) == 24 + 8
    stored = read_tensors(tmp_path / "q")
    assert all(f"{e}.qweight" in stored for e in experts) and not any(".mlp." in n for n in stored)
    routers = ["model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.gate.weight"]
    assert report["coverage"]["router"] == routers and all(r in stored for r in routers)
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    assert type(model.model.layers[1].mlp.experts[2].up_proj).__name__ in ("QuantLinear", "CpuInt4Linear")
    with torch.inference_mode():
        got = model(ids).logits
    folded = {n: p for n, p in model.named_parameters() if "norm" in n}  # AWQ's scales, folded into the norms
    torch.testing.assert_close(got, in_loop_logits(src, results, ids, folded), rtol=1e-4, atol=1e-4)
    if method == "rtn":
        assert "experts" not in report  # data-free: no tokens to count
        return
    tokens = report["experts"]["tokens"]
    for i in (0, 1):  # top-2 routing: each token reaches two experts of every block
        assert sum(tokens[f"model.layers.{i}.block_sparse_moe.experts.{e}"] for e in range(4)) == 2 * ids.numel()
    up = report["layers"]["model.layers.0.block_sparse_moe.experts.1.w3"]
    assert up["routed_tokens"] == tokens["model.layers.0.block_sparse_moe.experts.1"]  # gate and up read the same tokens
    assert up["tokens"] == ids.numel()  # --moe-calibration all (the default): statistics from every token


def test_routed_calibration_sees_the_routed_tokens_only_and_routes_alike(model_factory, tmp_path):
    src, ids = model_factory("mixtral"), calibration()
    reports = {mode: quantkit.quantize(str(src), tmp_path / mode, quantkit.QuantConfig(
        method="gptq", group_size=32, moe_calibration=mode), calibration_ids=ids) for mode in ("all", "routed")}
    every, routed = (reports[m]["layers"] for m in ("all", "routed"))
    expert = "model.layers.1.block_sparse_moe.experts.2.w2"
    assert routed[expert]["tokens"] == routed[expert]["routed_tokens"] < every[expert]["tokens"] == ids.numel()
    assert routed[expert]["error"] != every[expert]["error"]  # other statistics, other rounding
    # block 0 sees the same inputs in both modes, routed alike (block 1's differ with block 0's rounding)
    first = [f"model.layers.0.block_sparse_moe.experts.{e}" for e in range(4)]
    assert [reports["all"]["experts"]["tokens"][e] for e in first] == \
        [reports["routed"]["experts"]["tokens"][e] for e in first]
    assert "(statistics from all 128 tokens: --moe-calibration all)" in reports["all"]["experts"]["summary"]


def test_an_expert_no_token_reaches_is_rounded_to_nearest_and_named(tmp_path, monkeypatch):
    src = saved(gpt_oss(dead_expert=3), tmp_path / "src")
    ids = calibration()
    results = capture_results(monkeypatch)
    report = quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(method="gptq", group_size=32,
                                                                              moe_calibration="routed"),
                               calibration_ids=ids)
    dead = [f"model.layers.{i}.mlp.experts.3" for i in (0, 1)]
    assert report["experts"]["uncalibrated"] == dead
    assert "2 received none and were rounded to nearest (model.layers.0.mlp.experts.3, ...)" in \
        report["experts"]["summary"]
    layer = report["layers"]["model.layers.0.mlp.experts.3.down_proj"]
    assert layer["tokens"] == 0 and "rounded to nearest" in layer["fallback"] and "damp" not in layer
    assert report["layers"]["model.layers.0.mlp.experts.2.down_proj"]["tokens"] > 0
    with torch.inference_mode():
        got = quantkit.load_quantized(tmp_path / "q", device="cpu")(ids).logits
    torch.testing.assert_close(got, in_loop_logits(src, results, ids), rtol=1e-4, atol=1e-4)
    saved_report = json.loads((tmp_path / "q" / "quantkit_report.json").read_text())
    assert saved_report["experts"]["uncalibrated"] == dead
    # with --moe-calibration all the same expert is calibrated on every token, though none is routed to it
    every = quantkit.quantize(str(src), tmp_path / "all", quantkit.QuantConfig(method="gptq", group_size=32),
                              calibration_ids=ids)
    layer = every["layers"]["model.layers.0.mlp.experts.3.down_proj"]
    assert layer["routed_tokens"] == 0 and layer["tokens"] == ids.numel() and "fallback" not in layer
    assert every["experts"]["uncalibrated"] == []


def test_inspect_repeats_what_the_run_said(model_factory, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import main

    quantkit.quantize(str(model_factory("mixtral")), tmp_path / "q", quantkit.QuantConfig(method="gptq", group_size=32),
                      calibration_ids=calibration())
    out = CliRunner().invoke(main, ["inspect", str(tmp_path / "q")]).output
    assert "in floating point: 2 routers, lm_head, embeddings" in out
    assert "calibration tokens routed per expert: min" in out


FP4 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4(w):
    """w [E, out, in] as gpt-oss's release stores it: (blocks uint8 [E, out, in/32, 16], two e2m1 codes a byte, low
    nibble first; scales uint8 [E, out, in/32], exponent + 127; the values they decode to)."""
    groups = w.float().reshape(*w.shape[:2], -1, 32)
    exp = torch.floor(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6)).clamp(-127, 127)
    codes = (groups / torch.exp2(exp)[..., None] - FP4[:, None, None, None, None]).abs().argmin(0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8), (FP4[codes] * torch.exp2(exp)[..., None]).reshape(w.shape)


def test_mxfp4_experts_are_dequantized_on_load_and_quantized_as_their_values(tmp_path, capsys):
    """gpt-oss's release format: the same checkpoint as the floating-point model holding the MXFP4 values."""
    from safetensors.torch import load_file, save_file

    fp = gpt_oss()
    experts = {}
    for i, layer in enumerate(fp.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, proj)  # [E, in, out]
            blocks, scales, values = mxfp4(param.detach().transpose(1, 2))
            param.data = values.transpose(1, 2).contiguous()
            experts[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
            experts[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    saved(fp, tmp_path / "fp")
    saved(fp, tmp_path / "mx")
    tensors = {k: v for k, v in load_file(tmp_path / "mx" / "model.safetensors").items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **experts}, tmp_path / "mx" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "mx" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router"]}
    (tmp_path / "mx" / "config.json").write_text(json.dumps(config))
    for name in ("fp", "mx"):
        quantkit.quantize(str(tmp_path / name), tmp_path / f"q-{name}", quantkit.QuantConfig(group_size=32))
    assert "holds MXFP4 experts: transformers dequantizes them" in capsys.readouterr().err
    a, b = (load_file(tmp_path / f"q-{n}" / "model.safetensors") for n in ("fp", "mx"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    written = json.loads((tmp_path / "q-mx" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "gptq"  # the source's mxfp4 entry is not carried over

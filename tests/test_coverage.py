"""Every quantize says what it quantized and what stayed in floating point, and refuses to leave a weight it
cannot quantize in float without a word (transformers 5's fused 3-D experts, a layer the table does not list)."""
import json

import pytest
import yaml
from click.testing import CliRunner

from quantkit.cli import main



def quantize(src, out, *extra):
    return CliRunner().invoke(main, ["quantize", str(src), "-o", str(out), "--method", "rtn", "--group-size", "32",
                                     "--device", "cpu", *extra])


def test_a_dense_model_reports_its_share_and_what_stays_in_float(model_factory, tmp_path):
    result = quantize(model_factory("llama-gqa"), tmp_path / "q")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "q" / "quantkit_report.json").read_text())
    coverage = report["coverage"]
    # 2 blocks x (q, o 64x64 + k, v 32x64 under GQA + 3 x 64x96 MLP) quantized; the untied lm_head (512 x 64) not
    quantized = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 96)
    assert coverage["quantized_share"] == pytest.approx(quantized / (quantized + 512 * 64), rel=1e-5)
    assert coverage["lm_head"] == ["lm_head.weight"] and coverage["embeddings"] == ["model.embed_tokens.weight"]
    assert f"quantized {100 * coverage['quantized_share']:.1f} % of linear weights (14 linears); in floating " \
           "point: lm_head, embeddings" in result.output


def llama4_text(root):
    """Llama 4: a MoE block (router, batched experts, shared expert) on every layer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Llama4TextConfig

    from quantkit.demo import bundled_model_path

    config = Llama4TextConfig(vocab_size=512, hidden_size=64, intermediate_size=96, intermediate_size_mlp=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=4, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "src")
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(root / "src")
    return root / "src"


def test_experts_it_cannot_split_are_refused_by_name_with_the_override_that_keeps_them(tmp_path, monkeypatch):
    """A fused expert layout quantkit does not know: here Llama 4's, with its entry in moe.INPUT_SCALED taken out."""
    from quantkit.models import moe

    monkeypatch.setattr(moe, "INPUT_SCALED", {})
    src = llama4_text(tmp_path)
    result = quantize(src, tmp_path / "q")
    assert result.exit_code == 2 and not (tmp_path / "q").exists()
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: model.layers.0.feed_forward.experts.gate_up_proj [4, 64, 192] (and 3 more "
                           "weights) is a fused 3-D expert tensor") and (
        r"pattern: '\.(feed_forward\.experts\.down_proj|feed_forward\.experts\.gate_up_proj)$' skip: true" in line)
    recipe = tmp_path / "skip.yaml"
    recipe.write_text(yaml.safe_dump({"modules": [{"pattern": r"feed_forward\.experts", "skip": True}]}))
    result = quantize(src, tmp_path / "q", "--recipe", str(recipe))
    assert result.exit_code == 0, result.output
    assert "matches none" not in result.output  # the override keeps the experts: it is not a misspelling
    report = json.loads((tmp_path / "q" / "quantkit_report.json").read_text())
    coverage = report["coverage"]
    # the router (an nn.Linear named router) stays in float; the shared expert is quantized
    assert coverage["router"] == [f"model.layers.{i}.feed_forward.router.weight" for i in (0, 1)]
    assert "model.layers.0.feed_forward.router" not in report["layers"]
    assert "model.layers.0.feed_forward.shared_expert.down_proj" in report["layers"]
    assert coverage["recipe"] == [f"model.layers.{i}.feed_forward.experts.{p}" for i in (0, 1)
                                  for p in ("down_proj", "gate_up_proj")]
    assert "in floating point: 4 weight(s) kept by the recipe, 2 routers" in result.output


def test_a_router_of_an_unknown_family_is_never_rounded(model_factory):
    """Routers stay in floating point: the linears found in an unknown family's blocks leave them out."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    from quantkit.models.arch import arch_for, is_router

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = AutoModelForCausalLM.from_config(config)
    model.model.layers[0].mlp.gate = torch.nn.Linear(32, 4, bias=False)  # a router that is a plain nn.Linear
    assert is_router("mlp.gate", model.model.layers[0].mlp.gate.weight, 4)
    assert "mlp.gate" not in arch_for(model).sequential[0]
    assert "self_attn.q_proj" in arch_for(model).sequential[0]

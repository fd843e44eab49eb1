"""--target-bits and --target-size (issue 59): each linear's bits and group size chosen from its measured sensitivity
within a budget counted as the files store it; an exact knapsack; fused groups choose together; the recipe in OUT
reproduces it."""
import itertools
import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors import safe_open

import quantkit
from quantkit.cli import main
from quantkit.core import knapsack
from quantkit.core.errors import QuantkitError
from quantkit.run import allocate
from quantkit.schemes.rotation import Rotation

IDS = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
STORAGE = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed", ".weight_scale", ".weight_zero_point",
           ".weight_shape", ".codes", ".scale", ".rot_signs")


@pytest.mark.parametrize("seed", range(20))
def test_the_knapsack_is_exact_on_cases_brute_force_can_check(seed):
    g = torch.Generator().manual_seed(seed)
    items, options = 4, 3
    costs = torch.rand(items, options, generator=g).tolist()
    sizes = torch.randint(1, 20, (items, options), generator=g).tolist()
    budget = int(torch.randint(10, 60, (1,), generator=g))
    fitting = [sum(costs[i][j] for i, j in enumerate(c)) for c in itertools.product(range(options), repeat=items)
               if sum(sizes[i][j] for i, j in enumerate(c)) <= budget]
    best = (min(fitting),) if fitting else None
    chosen = knapsack.solve(costs, sizes, budget)
    if best is None:
        assert chosen is None
    else:
        assert sum(costs[i][j] for i, j in enumerate(chosen)) == pytest.approx(best[0])
        assert sum(sizes[i][j] for i, j in enumerate(chosen)) <= budget


def test_a_budget_cut_into_units_is_never_exceeded():
    sizes = [[1000003, 2000011, 4000037]] * 30
    costs = [[3.0, 2.0, 1.0]] * 30
    budget = 75_000_000
    chosen = knapsack.solve(costs, sizes, budget, resolution=1000)
    assert sum(sizes[0][j] for j in chosen) <= budget


@pytest.mark.parametrize("method,fmt", [("gptq", "gptq"), ("gptq", "compressed-tensors"), ("turboquant+gptq", "gptq"),
                                        ("e8+gptq", "gptq"), ("trellis", "gptq")])
@pytest.mark.parametrize("target", [3.4, 4.5])
def test_the_bits_counted_are_the_bits_the_files_store_and_never_over_budget(model_factory, tmp_path, method, fmt,
                                                                               target):
    """Integer widths and group sizes in the GPTQ and compressed-tensors layouts, a codebook method's rates in the
    quantkit format (codes, scales, g_idx and the rotation's signs)."""
    out = tmp_path / "q"
    report = quantkit.quantize(str(model_factory("llama-gqa")), out, quantkit.QuantConfig(
        method=method, target_bits=target, group_size=32, checkpoint_format=fmt,
        quantizer="trellis-l12" if method == "trellis" else None), calibration_ids=IDS)  # k, v: 32 rows
    stored, weights = 0, 0
    with safe_open(next(out.glob("*.safetensors")), "pt") as f:
        for key in f.keys():
            if key.endswith(STORAGE):
                t = f.get_tensor(key)
                stored += t.numel() * t.element_size() * 8
    weights = sum(v["shape"][0] * v["shape"][1] for v in report["layers"].values())
    assert stored / weights <= target
    said = float(report["target_bits"]["summary"][0].split(": ")[1].split(" bits")[0])
    assert said == pytest.approx(stored / weights, abs=1e-3)
    assert len({(v["bits"], v["group_size"]) for v in report["layers"].values()}) > 1  # a mix, not one setting


def test_fused_groups_take_one_setting_and_sensitive_layers_more_bits(model_factory, tmp_path):
    report = quantkit.quantize(str(model_factory("llama-gqa")), tmp_path / "q",
                               quantkit.QuantConfig(method="rtn", target_bits=3.5, group_size=32), calibration_ids=IDS)
    layers = report["layers"]
    for i in range(2):
        qkv = {(layers[f"model.layers.{i}.self_attn.{p}"]["bits"], layers[f"model.layers.{i}.self_attn.{p}"]
                ["group_size"]) for p in ("q_proj", "k_proj", "v_proj")}
        gate_up = {(layers[f"model.layers.{i}.mlp.{p}"]["bits"], layers[f"model.layers.{i}.mlp.{p}"]["group_size"])
                   for p in ("gate_proj", "up_proj")}
        assert len(qkv) == 1 and len(gate_up) == 1
    costs = report["target_bits"]["costs"]
    assert costs["model.layers.0.self_attn.v_proj"]["2-bit g32"] > costs["model.layers.0.self_attn.q_proj"]["2-bit g32"]


def test_the_recipe_in_out_reproduces_the_run_byte_for_byte(model_factory, tmp_path):
    src = str(model_factory("llama-gqa"))
    quantkit.quantize(src, tmp_path / "a", quantkit.QuantConfig(method="gptq", target_bits=3.2, group_size=32),
                      calibration_ids=IDS)
    recipe = yaml.safe_load((tmp_path / "a" / "quantkit_recipe.yaml").read_text())
    assert recipe["target_bits"] is None and len(recipe["modules"]) == 14
    quantkit.quantize(src, tmp_path / "b", quantkit.QuantConfig(**recipe), calibration_ids=IDS)
    a, b = (next((tmp_path / x).glob("*.safetensors")).read_bytes() for x in "ab")
    assert a == b


def test_a_budget_no_setting_meets_is_refused_before_any_work(model_factory, tmp_path):
    runner = CliRunner()
    done = runner.invoke(main, ["quantize", str(model_factory("llama-gqa")), "-o", str(tmp_path / "q"), "--method",
                                "rtn", "--target-bits", "1.5", "--dataset", str(_text(tmp_path)), "--nsamples", "2",
                                "--seqlen", "32", "--device", "cpu"])
    assert done.exit_code == 2 and "ask for at least 2." in done.output and "Traceback" not in done.output
    assert not (tmp_path / "q").exists()


def test_a_layer_no_rate_can_cut_is_named_with_its_reason_before_any_work(model_factory, tmp_path):
    """The trellis's tiles are 64 rows: k_proj's 32 are not (q_proj's 64 are, in the same fused q/k/v group)."""
    with pytest.raises(QuantkitError, match=r"k_proj: the trellis quantizer rounds tiles of 64 rows.*skip: true"):
        quantkit.quantize(str(model_factory("llama-gqa")), tmp_path / "q", quantkit.QuantConfig(
            method="trellis", target_bits=3.0, group_size=32), calibration_ids=IDS)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("settings,words", [
    (dict(method="gptq", checkpoint_format="awq", target_bits=3.0), "integer widths"),
    (dict(method="gptq", target_bits=3.0, modules=[{"pattern": "down", "bits": 8}]), "drop the recipe's per-module"),
    (dict(method="gptq", target_bits=0), "out of range"),
    (dict(method="gptq", target_bits=3.0, target_size="1GB"), "give one of them"),
    (dict(method="gptq", target_size="3.2 GB of disk"), "not understood"),
    (dict(method="gptq", quantizer="iq4nl", checkpoint_format="gguf", target_size="1GB"), "gguf-type auto"),
])
def test_what_target_bits_cannot_do_is_named(settings, words):
    with pytest.raises(QuantkitError, match=words):
        quantkit.QuantConfig(**settings)


def _text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("Once upon a time there was a little model that wanted to be small. " * 200)
    return path


def test_the_report_holds_the_choice_and_every_layers_cost(model_factory, tmp_path):
    quantkit.quantize(str(model_factory("llama-gqa")), tmp_path / "q",
                      quantkit.QuantConfig(method="rtn", target_bits=4.0, group_size=32), calibration_ids=IDS)
    report = json.loads((tmp_path / "q" / "quantkit_report.json").read_text())["target_bits"]
    assert report["target"] == 4.0 and report["predicted_kld"] > 0 and len(report["costs"]) == 14


@pytest.mark.parametrize("target", [dict(target_bits=3.3), dict(target_size="310KB")])
def test_a_resumed_run_continues_the_allocation_it_recorded(model_factory, tmp_path, monkeypatch, stop_at_part,
                                                            target):
    """The interrupted run's allocation is read back from its fingerprint: no second sensitivity pass, same bytes."""
    from quantkit.run import allocate

    src, out = str(model_factory("llama-gqa")), tmp_path / "q"
    config = quantkit.QuantConfig(method="rtn", group_size=32, **target)
    quantkit.quantize(src, tmp_path / "whole", config, calibration_ids=IDS)
    with stop_at_part("block-00001"), pytest.raises(KeyboardInterrupt):
        quantkit.quantize(src, out, config, calibration_ids=IDS)
    monkeypatch.setattr(allocate, "predicted_costs", lambda *a, **k: pytest.fail("measured again"))
    quantkit.quantize(src, out, config, calibration_ids=IDS, resume=True)
    a, b = (next(p.glob("*.safetensors")).read_bytes() for p in (tmp_path / "whole", out))
    assert a == b


def _files_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_a_target_size_is_never_exceeded_by_the_files(model_factory, tmp_path, fmt):
    """--target-size of a uniform 3-bit run's files: the mixed run's safetensors files (embeddings, head, norms and
    headers counted before the linears get the rest) fit it, and the bound the summary prints holds."""
    src = str(model_factory("llama-gqa"))
    quantkit.quantize(src, tmp_path / "uniform", quantkit.QuantConfig(method="rtn", bits=3, group_size=32,
                                                                      checkpoint_format=fmt))
    size = _files_bytes(tmp_path / "uniform")
    report = quantkit.quantize(src, tmp_path / "q", quantkit.QuantConfig(
        method="rtn", target_size=size, group_size=32, checkpoint_format=fmt), calibration_ids=IDS)
    got = _files_bytes(tmp_path / "q")
    bound = float(report["target_bits"]["summary"][1].split("at most ")[1].split(" MB")[0]) * 1e6
    assert report["target_bits"]["size"] == size and got <= size and got <= bound + 500


def test_a_size_the_float_tensors_already_fill_is_refused_before_any_work(model_factory, tmp_path):
    done = CliRunner().invoke(main, ["quantize", str(model_factory("llama-gqa")), "-o", str(tmp_path / "q"),
                                     "--method", "rtn", "--target-size", "50KB", "--dataset", str(_text(tmp_path)),
                                     "--nsamples", "2", "--seqlen", "32", "--device", "cpu"])
    assert done.exit_code == 2 and "kept in float take" in done.output and "ask for at least" in done.output
    assert "Traceback" not in done.output and not (tmp_path / "q").exists()


def test_feedback_gains_predict_what_gptq_makes_of_a_setting():
    """GPTQ's output error on correlated inputs is far below rounding's; the gains bring the estimate to it."""
    from quantkit.algorithms.gptq import GPTQ, feedback_gains
    from quantkit.run.allocate import Setting, rounding_error
    from quantkit.schemes.grid import Grid

    g = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=g) + 3 * torch.eye(64)  # inputs with strongly correlated features
    x = torch.randn(4096, 64, generator=g) @ mix
    w = torch.randn(32, 64, generator=g)
    gptq = GPTQ(w)
    gptq.add_batch(x)
    H = x.t() @ x / len(x)
    error = w - gptq.quantize(Grid(3, sym=True), group_size=32, act_order=True).dequantize()
    measured = float(torch.einsum("oi,ij,oj->", error, H, error))
    rounded = rounding_error(w, Setting(3, 32), sym=True)
    gains = feedback_gains(H, act_order=True)
    assert float((rounded * H.diagonal()).sum()) > 2 * measured  # what rounding alone would predict
    assert float((rounded * H.diagonal() * gains).sum()) == pytest.approx(measured, rel=0.35)
    assert bool((gains > 0).all()) and bool((gains <= 1).all())


def test_feedback_gains_of_uncorrelated_inputs_are_one():
    """Nothing later can take up a column's error when no input correlates with it: GPTQ rounds as RTN does."""
    from quantkit.algorithms.gptq import feedback_gains

    H = torch.diag(torch.rand(16, generator=torch.Generator().manual_seed(0)) + 0.5)
    for act_order in (True, False):
        assert torch.allclose(feedback_gains(H, act_order=act_order), torch.ones(16), rtol=1e-5)


def test_the_rotated_basis_estimate_is_exact_where_it_claims():
    """Behind --rotate hadamard the estimate is taken in the basis the method rounds in: the Fisher diagonal of W Πᵀ
    is the diagonal of Π diag(f) Πᵀ (block means, exactly), the Hessian Π H Πᵀ, the weight W Πᵀ, the method's own Π."""
    gen = torch.Generator().manual_seed(0)
    w, fisher = torch.randn(3, 96, generator=gen), torch.rand(3, 96, generator=gen)
    x = torch.randn(200, 96, generator=gen)
    hessian = x.t() @ x / 200
    rw, rf, rh = allocate.rotated("model.layers.0.mlp.down_proj", w, fisher, hessian, seed=0)
    rotation = Rotation.for_layer("model.layers.0.mlp.down_proj", 96, 0)
    pi = rotation.rotate_weight(torch.eye(96)).t()  # W Πᵀ = rotate_weight(W)
    for r in range(3):
        assert torch.allclose(rf[r], torch.diagonal(pi @ torch.diag(fisher[r]) @ pi.t()), atol=1e-6)
    assert torch.allclose(rw, w @ pi.t(), atol=1e-5) and torch.allclose(rh, pi @ hessian @ pi.t(), atol=1e-5)


def test_a_codebook_allocation_reproduces_from_the_recipe_in_out(model_factory, tmp_path):
    src = str(model_factory("llama-gqa"))
    quantkit.quantize(src, tmp_path / "a", quantkit.QuantConfig(method="turboquant+gptq", target_bits=3.4,
                                                                group_size=32), calibration_ids=IDS)
    recipe = yaml.safe_load((tmp_path / "a" / "quantkit_recipe.yaml").read_text())
    quantkit.quantize(src, tmp_path / "b", quantkit.QuantConfig(**recipe), calibration_ids=IDS)
    a, b = (next((tmp_path / x).glob("*.safetensors")).read_bytes() for x in "ab")
    assert a == b and len({m["bits"] for m in recipe["modules"]}) > 1

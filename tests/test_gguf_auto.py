"""--gguf-type auto (issue 59): each tensor's llama.cpp block type chosen for --target-bits from its measured
sensitivity; a recipe's block_type sets one by hand. Bits counted from model.gguf as llama.cpp reads it."""
import pytest
import torch
import yaml

import quantkit
from quantkit.core import knapsack
from quantkit.core.errors import QuantkitError
from quantkit.gguf.auto import AUTO_TYPES, TYPES

gguf = pytest.importorskip("gguf")  # the test extra's reference reader

IDS = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
SUPER_BLOCK_TYPES = {t for t in AUTO_TYPES if TYPES[t].block == 256}


def file_types(out) -> dict:
    """{GGUF tensor name: (block type, bits per weight as stored)} of model.gguf's quantized tensors."""
    reader = gguf.GGUFReader(out / "model.gguf")
    return {t.name: (t.tensor_type.name, 8 * int(t.n_bytes) / int(t.n_elements)) for t in reader.tensors
            if t.tensor_type.name in TYPES}


def stored_bits_per_weight(out) -> float:
    reader = gguf.GGUFReader(out / "model.gguf")
    quantized = [t for t in reader.tensors if t.tensor_type.name in TYPES]
    return 8 * sum(int(t.n_bytes) for t in quantized) / sum(int(t.n_elements) for t in quantized)


@pytest.mark.parametrize("method,target", [("rtn", 4.6), ("gptq", 3.6)])
def test_auto_types_stay_within_the_budget_counted_from_the_file(model_factory, tmp_path, method, target):
    out = tmp_path / "q"
    report = quantkit.quantize(str(model_factory("llama-256")), out, quantkit.QuantConfig(
        method=method, gguf_type="auto", target_bits=target), calibration_ids=IDS)
    types = file_types(out)
    assert stored_bits_per_weight(out) <= target
    said = float(report["target_bits"]["summary"][0].split(": ")[1].split(" bits")[0])
    assert said == pytest.approx(stored_bits_per_weight(out), abs=1e-3)
    assert len({t for t, _ in types.values()}) >= 2  # a mix
    assert {t for t, _ in types.values()} <= set(AUTO_TYPES)
    downs = {t for name, (t, _) in types.items() if "ffn_down" in name}  # 288 inputs: blocks of 32 only
    assert downs and not downs & SUPER_BLOCK_TYPES
    assert "Infinity" not in (out / "quantkit_report.json").read_text()  # strict JSON: types a layer cannot take left out


def test_the_auto_recipe_in_out_reproduces_the_file_byte_for_byte(model_factory, tmp_path):
    src = str(model_factory("llama-256"))
    quantkit.quantize(src, tmp_path / "a", quantkit.QuantConfig(method="gptq", gguf_type="auto", target_bits=4.0),
                      calibration_ids=IDS)
    recipe = yaml.safe_load((tmp_path / "a" / "quantkit_recipe.yaml").read_text())
    assert recipe["gguf_type"] == "auto" and all("block_type" in m for m in recipe["modules"])
    quantkit.quantize(src, tmp_path / "b", quantkit.QuantConfig(**recipe), calibration_ids=IDS)
    assert (tmp_path / "a" / "model.gguf").read_bytes() == (tmp_path / "b" / "model.gguf").read_bytes()


def test_a_recipe_block_type_overrides_the_file_types_mix(model_factory, tmp_path):
    out = tmp_path / "q"
    quantkit.quantize(str(model_factory("llama-256")), out, quantkit.QuantConfig(
        method="rtn", gguf_type="Q4_K_M", modules=[{"pattern": r"layers\.1\.self_attn\.q_proj", "block_type": "Q8_0"}]))
    types = file_types(out)
    assert types["blk.1.attn_q.weight"][0] == "Q8_0" and types["blk.0.attn_q.weight"][0] == "Q4_K"


@pytest.mark.parametrize("settings,words", [
    (dict(gguf_type="auto"), "give --target-bits"),
    (dict(gguf_type="Q4_K_M", target_bits=4.0), "--gguf-type auto"),
    (dict(gguf_type="auto", target_size="0.5MB"), "ask for at least"),
    (dict(modules=[{"pattern": "q_proj", "block_type": "Q4_K"}]), "needs a GGUF file"),
    (dict(gguf_type="Q4_0", modules=[{"pattern": "q_proj", "block_type": "Q3_K_M"}]), "not a block type"),
    (dict(gguf_type="auto", target_bits=4.0, modules=[{"pattern": "q_proj", "block_type": "Q4_K"}]),
     "drop the recipe's per-module"),
])
def test_what_auto_cannot_do_is_refused_by_name(model_factory, tmp_path, settings, words):
    with pytest.raises(QuantkitError, match=words):
        quantkit.quantize(str(model_factory("llama-256")), tmp_path / "q", quantkit.QuantConfig(method="rtn",
                                                                                                **settings),
                          calibration_ids=IDS)
    assert not (tmp_path / "q" / "model.gguf").exists()


@pytest.mark.parametrize("size", [1_450_000, 1_550_000])
def test_a_target_size_bounds_the_gguf_file(model_factory, tmp_path, size):
    """The whole model.gguf (metadata, tokenizer, float tensors, padding) within the size, and the summary's bound
    no more than the unknown padding above the file."""
    out = tmp_path / "q"
    report = quantkit.quantize(str(model_factory("llama-256")), out, quantkit.QuantConfig(
        method="rtn", gguf_type="auto", target_size=str(size)), calibration_ids=IDS)
    actual = (out / "model.gguf").stat().st_size
    bound = float(report["target_bits"]["summary"][1].split("at most ")[1].split(" MB")[0]) * 1e6
    assert actual <= size and actual <= bound + 1e3 and bound - actual < 32 * 14 + 1e3
    assert size - actual < 0.03 * size  # the budget is used


def test_the_knapsack_skips_options_an_item_cannot_take():
    costs, sizes = [[0.0, 5.0], [0.0, 5.0]], [[None, 3], [4, 6]]
    assert knapsack.solve(costs, sizes, 10) == [1, 0]
    assert knapsack.solve([[0.0]], [[None]], 10) is None


def test_a_resumed_auto_run_continues_the_types_it_chose(model_factory, tmp_path, monkeypatch, stop_at_part):
    """The interrupted run's block types come back from its fingerprint: no second sensitivity pass, same file."""
    from quantkit.run import allocate

    src, out = str(model_factory("llama-256")), tmp_path / "q"
    config = quantkit.QuantConfig(method="rtn", gguf_type="auto", target_bits=4.6)
    quantkit.quantize(src, tmp_path / "whole", config, calibration_ids=IDS)
    with stop_at_part("block-00001"), pytest.raises(KeyboardInterrupt):
        quantkit.quantize(src, out, config, calibration_ids=IDS)
    monkeypatch.setattr(allocate, "predicted_costs", lambda *a, **k: pytest.fail("measured again"))
    quantkit.quantize(src, out, config, calibration_ids=IDS, resume=True)
    assert (tmp_path / "whole" / "model.gguf").read_bytes() == (out / "model.gguf").read_bytes()

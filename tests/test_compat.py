"""The compat report (which readers refuse a run's checkpoint, before any work), fused-group overrides and
the `dynamic` map that vLLM's fused names match (issue 11)."""
import json
import re

import pytest
import torch
from click.testing import CliRunner

from quantkit.api import load_quantized, quantize
from quantkit.cli import main
from quantkit.run.config import QuantConfig
from quantkit.core.errors import QuantkitError
from quantkit.checkpoint import compat, gptq, validate
from quantkit.run.precheck import writer_codec

LLAMA_QKV = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")
FUSED = {"model.layers.0.self_attn.qkv_proj": LLAMA_QKV}


SIBLINGS = {n: tuple(m for m in LLAMA_QKV if m != n) for n in LLAMA_QKV}


def _check(config, specs=None, shapes=None):
    """What quantize reports for the codec the settings pick (quantkit.run.precheck.writer_codec)."""
    specs = specs or {n: config.spec_for(n, SIBLINGS[n]) for n in LLAMA_QKV}
    shapes = shapes or {n: (512, 512) for n in specs}
    return writer_codec(config, specs).compat_problems(config, specs, shapes, FUSED)


def _readers(problems):
    return sorted({p.reader for p in problems})


def test_sym_4bit_g128_on_aligned_shapes_is_accepted_everywhere():
    assert _check(QuantConfig(bits=4, group_size=128, sym=True)) == []
    assert _check(QuantConfig(bits=8, group_size=-1, sym=True)) == []


@pytest.mark.parametrize("bits,sym", [(3, True), (2, True), (4, False), (8, False)])
def test_vllm_serves_sym_4_and_8_bit_only(bits, sym):
    problems = _check(QuantConfig(bits=bits, group_size=128, sym=sym, checkpoint_format="gptq_v2"))
    assert _readers(problems) == ["vllm"]
    assert f"{bits}-bit {'sym' if sym else 'asym'}" in problems[0].reason and "--sym" in problems[0].fix


def test_group_size_without_a_kernel():
    problems = _check(QuantConfig(bits=4, group_size=256))  # GPTQModel has one, Marlin not
    assert _readers(problems) == ["vllm"]
    problems = _check(QuantConfig(bits=4, group_size=48), shapes={n: (480, 512) for n in LLAMA_QKV})
    assert _readers(problems) == ["gptqmodel", "transformers", "vllm"]


def test_short_last_group_names_the_layer_and_a_group_size_that_divides():
    problems = _check(QuantConfig(bits=4, group_size=128), shapes={n: (576, 576) for n in LLAMA_QKV})
    assert _readers(problems) == ["vllm"]
    assert "576 inputs" in problems[0].reason and problems[0].fix.startswith("--group-size 64")
    problems = _check(QuantConfig(bits=4, group_size=32), shapes={n: (172, 64) for n in LLAMA_QKV})
    assert problems[0].fix.startswith("--group-size -1")


def test_overrides_spread_over_fused_groups_unless_split():
    config = QuantConfig(bits=4, group_size=128, modules=[{"pattern": r"q_proj$", "bits": 8}])
    assert {config.spec_for(n, SIBLINGS[n]).bits for n in LLAMA_QKV} == {8}
    assert config.spec_for("model.layers.0.mlp.down_proj").bits == 4
    assert _readers(_check(config)) == ["transformers"]  # overrides: GPTQConfig has no dynamic
    split = QuantConfig(bits=4, group_size=128, modules=[{"pattern": r"q_proj$", "bits": 8, "split_fused": True}])
    assert [split.spec_for(n, SIBLINGS[n]).bits for n in LLAMA_QKV] == [8, 4, 4]
    problems = _check(split)
    assert _readers(problems) == ["transformers", "vllm"]
    assert any("qkv_proj" in p.reason and "split_fused" in p.fix for p in problems)


def test_gptqmodel_refuses_asymmetric_v1_and_3bit_widths_off_32():
    asym = _check(QuantConfig(bits=4, group_size=128, sym=False))
    assert [p.fix for p in asym if p.reader == "gptqmodel"] == ["--checkpoint-format gptq_v2 (the zeros as they are)"]
    assert "gptqmodel" not in _readers(_check(QuantConfig(bits=4, group_size=128, sym=False,
                                                          checkpoint_format="gptq_v2")))
    odd = _check(QuantConfig(bits=3, group_size=128, checkpoint_format="gptq_v2"), shapes={n: (512, 48) for n in LLAMA_QKV})
    assert [p.reason for p in odd if p.reader == "gptqmodel"] == [
        "its 3-bit layers need out_features divisible by 32, and model.layers.0.self_attn.k_proj has 48"]
    assert "gptqmodel" not in _readers(_check(QuantConfig(bits=3, group_size=128, checkpoint_format="gptq_v2")))


@pytest.mark.parametrize("settings,shape,readers,words", [
    (dict(bits=3), (512, 512), [], ""),  # vLLM 0.33 serves 2-8 bits (Humming)
    (dict(bits=2, group_size=64, sym=False), (512, 512), ["transformers"], "asymmetric compressed-tensors"),
    (dict(bits=4, group_size=256), (512, 512), [], ""),
    (dict(bits=3, group_size=8), (512, 512), ["vllm"], "group size 8 is under the 16 its Humming kernel needs"),
    (dict(bits=4, group_size=8), (512, 512), [], ""),  # symmetric 4-bit: Exllama takes any group
    (dict(bits=4, group_size=128), (576, 512), ["transformers", "vllm"], "576 inputs, not a multiple of group size"),
    (dict(bits=8, group_size=128, sym=False), (512, 512), ["transformers"], "(a size mismatch for weight_zero_point)"),
])
def test_compressed_tensors_output_is_checked_against_its_readers(settings, shape, readers, words):
    config = QuantConfig(**settings, checkpoint_format="compressed-tensors")
    problems = _check(config, shapes={n: shape for n in LLAMA_QKV})
    assert _readers(problems) == readers and all(words in p.reason for p in problems)
    if readers:
        with pytest.raises(QuantkitError, match="--compat any"):
            compat.enforce(problems, "any")


def test_quantkit_format_is_refused_by_every_reader_but_transformers_after_import_quantkit():
    problems = _check(QuantConfig(method="turboquant", bits=4, group_size=128))
    assert _readers(problems) == ["gptqmodel", "vllm"] and "quantkit" in problems[0].reason


def test_enforce_raises_only_for_the_target():
    problems = _check(QuantConfig(bits=3, group_size=128))
    assert compat.enforce(problems, "none") == [
        "vllm will refuse this checkpoint: its GPTQ path serves symmetric 4- and 8-bit only, not 3-bit sym "
        "(fix: --checkpoint-format compressed-tensors (vLLM serves 2- to 8-bit weights, symmetric or not, there), or "
        "--bits 4 (or 8) --sym)"]
    assert compat.enforce(problems, "gptqmodel") == compat.lines(problems)
    for target in ("vllm", "any"):
        with pytest.raises(QuantkitError, match=f"--compat {target}: vllm will refuse"):
            compat.enforce(problems, target)


def test_unknown_compat_target_is_refused():
    with pytest.raises(QuantkitError, match="--compat 'tgi'"):
        QuantConfig(compat="tgi")


def test_dynamic_keys_match_hf_and_vllm_fused_names():
    from quantkit.schemes.grid import Grid
    from quantkit.algorithms.rtn import rtn

    mk = lambda bits: rtn(torch.randn(8, 32), Grid(bits), 32)  # noqa: E731
    gate_up = ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    names = [*LLAMA_QKV, *gate_up, "model.layers.0.mlp.down_proj"]
    results = {n: mk(8) for n in LLAMA_QKV} | {gate_up[0]: mk(8), "model.layers.0.mlp.down_proj": mk(4)}
    fused = FUSED | {"model.layers.0.mlp.gate_up_proj": gate_up}
    qc = gptq.quantization_config(4, 32, True, True, "gptq", results, names, fused=fused)
    keys = list(qc["dynamic"])
    # q/k/v share 8 bits: one key; gate/up are split (gate 8-bit, up in float): a key each
    assert keys == [r"+:^model\.layers\.0\.self_attn\.(?:q_proj|k_proj|v_proj|qkv_proj)$",
                    r"+:^model\.layers\.0\.mlp\.gate_proj$", r"-:^model\.layers\.0\.mlp\.up_proj$"]
    pattern = keys[0][2:]
    for name in [*LLAMA_QKV, "model.layers.0.self_attn.qkv_proj"]:
        assert re.match(pattern, name)
    assert not re.match(pattern, "model.layers.0.self_attn.o_proj")
    assert not re.match(pattern, "model.layers.10.self_attn.q_proj")
    assert validate.module_settings(qc, LLAMA_QKV[1]) == (8, 32, True)
    assert validate.module_settings(qc, "model.layers.0.mlp.down_proj") == (4, 32, True)
    # static-group act-order keeps g_idx = k // group_size: readers must not take the act-order path
    assert qc["desc_act"] is False and qc["static_groups"] is True


def test_dynamic_first_match_wins_like_the_readers():
    qc = {"bits": 4, "group_size": 128, "dynamic": {r"+:.*q_proj": {"bits": 8}, r".*proj": {"bits": 2}}}
    assert validate.module_settings(qc, "m.q_proj") == (8, 128, True)
    assert validate.module_settings(qc, "m.k_proj") == (2, 128, True)   # a key without a sign is a positive match


def test_quantize_fused_override_loads_and_warns(model_factory, tmp_path, capsys):
    config = QuantConfig(bits=4, group_size=32, modules=[{"pattern": r"layers\.0\.self_attn\.k_proj", "bits": 8}])
    quantize(str(model_factory("llama")), tmp_path / "q", config, device="cpu")
    err = capsys.readouterr().err
    assert "warning: transformers will refuse this checkpoint" in err and "vllm" not in err
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert list(qc["dynamic"]) == [r"+:^model\.layers\.0\.self_attn\.(?:q_proj|k_proj|v_proj|qkv_proj)$"]
    model = load_quantized(tmp_path / "q", device="cpu")
    assert [model.get_submodule(n).bits for n in LLAMA_QKV] == [8, 8, 8]
    assert model.get_submodule("model.layers.0.self_attn.o_proj").bits == 4
    report = json.loads((tmp_path / "q" / "quantkit_report.json").read_text())
    assert report["compat"] and report["compat"][0].startswith("transformers")


def test_cli_compat_error_before_any_work(model_factory, tmp_path):
    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["quantize", str(model_factory("llama")), "-o", str(out), "--asym",
                                       "--group-size", "32", "--compat", "vllm", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "vllm will refuse" in errors[0] and "4-bit asym" in errors[0] and "--sym" in errors[0]
    assert not out.exists()


def test_gptq_experts_fused_in_transformers_are_refused_for_it_with_the_format_that_loads(model_factory, tmp_path):
    """transformers 5.24 loads a GPTQ mixture-of-experts folder with random experts and no error (issue 58)."""
    src = str(model_factory("mixtral"))
    with pytest.raises(QuantkitError, match=r"--compat transformers: transformers will refuse this checkpoint: it "
                                            r"loads a GPTQ mixture-of-experts folder with its experts randomly "
                                            r".*fix: --checkpoint-format compressed-tensors"):
        quantize(src, tmp_path / "q", QuantConfig(method="rtn", group_size=32, compat="transformers"))
    assert not (tmp_path / "q").exists()
    quantize(src, tmp_path / "ct", QuantConfig(method="rtn", group_size=32, compat="transformers",
                                               checkpoint_format="compressed-tensors"))


def test_3bit_compressed_tensors_passes_compat_vllm_and_asym_fails_compat_transformers(model_factory, tmp_path):
    src = model_factory("llama")
    common = ["quantize", str(src), "--method", "rtn", "--group-size", "32", "--checkpoint-format",
              "compressed-tensors", "--device", "cpu"]
    done = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "w3"), "--bits", "3", "--compat", "vllm"])
    assert done.exit_code == 0, done.output
    done = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "asym"), "--asym", "--compat", "transformers"])
    assert done.exit_code == 2 and "weight_zero_point" in done.output and "fix: --sym" in done.output
    assert not (tmp_path / "asym").exists()


def test_transformers_517_renamed_router_is_a_warning_that_names_the_dtype_that_loads():
    """transformers 5.17 to 5.20 load a float tensor they rename (Mixtral's block_sparse_moe.gate, their mlp.gate) in
    its stored dtype: a compressed-tensors Mixtral from fp16 crashes with dtype=torch.float32 there (issue 58). They
    serve it in the config's dtype, so it is a warning, never a --compat refusal; Qwen3-MoE's router keeps its name."""
    from transformers import AutoModelForCausalLM

    from quantkit.models.names import FileNames
    from tiny_models import CONFIGS

    model = AutoModelForCausalLM.from_config(CONFIGS["mixtral"]())
    kinds = {"router": {"model.layers.0.mlp.gate.weight": 256, "model.layers.1.mlp.gate.weight": 256},
             "embeddings": {"model.embed_tokens.weight": 1}, "lm_head": {"lm_head.weight": 1},
             "quantized": {"model.layers.0.mlp.experts.0.gate_proj.weight": 1}}
    renamed = compat.renamed_floats(kinds, FileNames(model).of_tensor)
    assert renamed == ["model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.gate.weight"]
    problems = compat.transformers_renamed_floats(renamed)
    assert [(p.reader, p.fatal) for p in problems] == [("transformers", False)]
    assert "5.17 to 5.20" in problems[0].reason and "dtype='auto'" in problems[0].fix
    for target in ("transformers", "any"):
        assert compat.enforce(problems, target) == [
            f"transformers may fail on this checkpoint: {problems[0].reason} (fix: {problems[0].fix})"]
    assert compat.renamed_floats({"router": {"model.layers.0.mlp.gate.weight": 1}}, lambda n: n) == []
    assert compat.transformers_renamed_floats([]) == []


def test_compressed_tensors_mixtral_router_is_written_in_the_config_dtype_under_its_file_name(tmp_path):
    """What transformers 5.17 to 5.20 load (they keep the router as stored): the router in the dtype config.json
    states, which from_pretrained's default dtype asks for, named as the files name it (vLLM refuses mlp.gate)."""
    from safetensors import safe_open

    from tiny_models import make_model_folder

    src = make_model_folder("mixtral", tmp_path / "src", dtype=torch.float16)
    config = QuantConfig(method="rtn", group_size=32, checkpoint_format="compressed-tensors")
    quantize(str(src), tmp_path / "ct", config, device="cpu")
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["dtype"] == "float16"
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        routers = {k: f.get_slice(k).get_dtype() for k in f.keys() if k.endswith("gate.weight")}
    assert routers == {f"model.layers.{i}.block_sparse_moe.gate.weight": "F16" for i in range(2)}


def test_quantize_warns_of_the_renamed_router_and_still_writes_under_compat_transformers(model_factory, tmp_path):
    config = QuantConfig(method="rtn", bits=4, group_size=32, checkpoint_format="compressed-tensors",
                         compat="transformers")
    report = quantize(str(model_factory("mixtral")), tmp_path / "ct", config)
    assert any("transformers may fail on this checkpoint" in line and "block_sparse_moe.gate.weight" in line
               for line in report["compat"])
    assert (tmp_path / "ct" / "config.json").exists()

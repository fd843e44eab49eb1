"""The CLI through click's CliRunner: the contract, recipes, and every bad input named in the issue."""
import json

import pytest
from click.testing import CliRunner

from quantkit.cli import main


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


def assert_user_error(result, *words):
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    for w in words:
        assert w in result.output, result.output


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text("\n".join(f"Once upon a time there was a little cat number {i} who liked to play." for i in range(300)))
    return path


@pytest.mark.parametrize("cmd", [[], ["quantize"], ["eval"], ["eval", "perplexity"], ["inspect"], ["demo"]])
def test_help_explains_every_option(cmd):
    result = run(*cmd, "--help")
    assert result.exit_code == 0
    for line in result.output.splitlines():
        if line.strip().startswith("--") and "--help" not in line:
            assert len(line.split("  ")) > 1 or line.endswith("]"), line


def test_quantize_inspect_eval(model_factory, tmp_path, text_file):
    out = tmp_path / "q"
    result = run("quantize", model_factory("llama"), "-o", out, "--method", "gptq", "--bits", 4, "--group-size", 32,
                 "--dataset", text_file, "--nsamples", 4, "--seqlen", 64, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "rel. output error" in result.output and (out / "quantkit_report.json").is_file()
    info = json.loads(run("inspect", out, "--json").output)
    layer = info["layers"]["model.layers.0.mlp.down_proj"]
    assert layer["method"] == "gptq" and layer["bits"] == 4 and layer["group_size"] == 32
    # 4 bits + (16-bit scale + 4-bit zero) / 32 per weight
    assert layer["bits_per_weight"] == pytest.approx(4 + 20 / 32, abs=0.01)
    assert "bits/weight" in run("inspect", out).output
    result = run("eval", "perplexity", out, "--dataset", text_file, "--seqlen", 64, "--max-tokens", 256, "--json",
                 "--device", "cpu")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert data["tokens"] == 4 * 63 and data["ppl"] > 1


def test_recipe_with_cli_override(model_factory, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("bits: 8\ngroup-size: 32\nmodules:\n  - pattern: 'down_proj'\n    skip: true\n")
    out = tmp_path / "q"
    result = run("quantize", model_factory("llama"), "-o", out, "--recipe", recipe, "--group-size", 16)
    assert result.exit_code == 0, result.output
    saved = (out / "quantkit_recipe.yaml").read_text()
    assert "bits: 8" in saved and "group_size: 16" in saved
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == 8 and qc["group_size"] == 16 and "-:^model\\.layers\\.0\\.mlp\\.down_proj$" in qc["dynamic"]
    # the saved recipe repeats the run
    again = run("quantize", model_factory("llama"), "-o", tmp_path / "q2", "--recipe", out / "quantkit_recipe.yaml")
    assert again.exit_code == 0, again.output
    assert (tmp_path / "q2" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_recipe_pattern_that_matches_nothing_is_reported(model_factory, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("modules:\n  - pattern: 'down_prj'\n    bits: 8\n  - pattern: 'down_proj'\n    bits: 8\n")
    result = run("quantize", model_factory("llama"), "-o", tmp_path / "q", "--recipe", recipe, "--group-size", 32)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "matches none" in line]
    assert len(warnings) == 1 and "modules[0] pattern 'down_prj'" in warnings[0] and "check its spelling" in warnings[0]


def test_toml_recipe(model_factory, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('bits = 3\ngroup_size = -1\nsym = false\n')
    result = run("quantize", model_factory("llama"), "-o", tmp_path / "q", "--recipe", recipe)
    assert result.exit_code == 0, result.output
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"], qc["sym"]) == (3, -1, False)


def test_bad_inputs(model_factory, tmp_path, text_file):
    src = model_factory("llama")
    assert_user_error(run("quantize", tmp_path / "nope", "-o", tmp_path / "o"), "not found")
    assert_user_error(run("quantize", src, "-o", tmp_path / "o", "--bits", 5), "--bits 5", "2, 3, 4, 8")
    assert_user_error(run("quantize", src, "-o", tmp_path / "o", "--group-size", 0), "--group-size 0")
    assert_user_error(run("quantize", src, "-o", tmp_path / "o", "--group-size", -2), "--group-size -2")
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    assert_user_error(run("quantize", src, "-o", existing), "already exists", "--overwrite")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_user_error(run("quantize", src, "-o", tmp_path / "o", "--method", "gptq", "--dataset", empty,
                          "--seqlen", 64), "empty")
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    assert_user_error(run("quantize", src, "-o", tmp_path / "o", "--method", "gptq", "--dataset", short,
                          "--seqlen", 64), "--seqlen")
    assert_user_error(run("quantize", src, "-o", tmp_path / "o", "--method", "gptq", "--dataset", "nosuchset",
                          "--seqlen", 64), "nosuchset")
    bad_recipe = tmp_path / "bad.yaml"
    bad_recipe.write_text("bitz: 4\n")
    assert_user_error(run("quantize", src, "-o", tmp_path / "o", "--recipe", bad_recipe), "bitz")
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_bad_checkpoints(model_factory, tmp_path, text_file):
    out = tmp_path / "q"
    assert run("quantize", model_factory("llama"), "-o", out).exit_code == 0
    # a folder without quantization_config
    assert_user_error(run("inspect", model_factory("llama")), "quantization_config")
    assert_user_error(run("inspect", tmp_path / "missing"), "not found")
    # truncated safetensors
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_user_error(run("eval", "perplexity", out, "--dataset", text_file, "--seqlen", 32, "--device", "cpu"),
                      "truncated or corrupted")
    # corrupted header
    (out / "model.safetensors").write_bytes(b"\xff" * 64)
    assert_user_error(run("inspect", out), "truncated or corrupted")


def test_demo_runs_offline(tmp_path):
    result = run("demo", "--tokens", 1024, "-o", tmp_path / "demo")
    assert result.exit_code == 0, result.output
    assert "| fp32 |" in result.output and "rtn w4 g32" in result.output
    assert (tmp_path / "demo" / "config.json").is_file()


def test_demo_keeps_the_layers_e8_cannot_split_in_floating_point_and_says_so(tmp_path):
    from safetensors import safe_open

    # the bundled model's down_proj has 172 inputs, not a multiple of E8's 8 columns: quantize refuses it, and the
    # demo applies the override that error names
    result = run("demo", "--method", "e8", "--bits", 2, "--tokens", 512, "-o", tmp_path / "demo")
    assert result.exit_code == 0, result.output
    assert "kept in floating point: 5 layers matching (mlp\\.down_proj)$" in result.output
    assert "| e8 w2 g32 |" in result.output
    with safe_open(tmp_path / "demo" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.down_proj.weight" in names  # left in floating point
    assert "model.layers.0.mlp.up_proj.weight" not in names  # quantized


@pytest.mark.parametrize("error", [MemoryError(), "cuda"])
def test_out_of_memory_is_one_line_not_a_traceback(model_factory, text_file, monkeypatch, error):
    import torch

    import quantkit.eval

    def oom(*args, **kwargs):
        raise error if error != "cuda" else torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(quantkit.eval, "evaluate_path", oom)
    result = run("eval", "perplexity", model_factory("llama"), "--dataset", text_file, "--device", "cpu")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("error: out of memory") and "--stream" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output

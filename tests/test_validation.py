"""Input validation at the boundary: damaged sources, tampered checkpoints and mistyped recipes give one
`error:` line naming the problem, exit code 2 and nothing written — never a traceback or a silent wrong result."""
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantkit.cli import main
from quantkit.run.config import QuantConfig
from quantkit.core.errors import QuantkitError
from quantkit.run.load import load_quantized


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(result, *words):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: "), result.output
    for w in words:
        assert w in last, last


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text("\n".join(f"Once upon a time a little dog number {i} ran home." for i in range(200)))
    return path


def edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# --------------------------------------------------------------------------- the source model


@pytest.fixture
def source(tmp_path, model_factory):
    folder = tmp_path / "src"
    shutil.copytree(model_factory("llama"), folder)
    return folder


def quantize_refused(tmp_path, src, *extra, words=()):
    result = run("quantize", src, "-o", tmp_path / "out", "--group-size", 32, *extra)
    assert_user_error(result, *words)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_non_finite_source_weight(tmp_path, source, text_file, value, method):
    def poison(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 5] = value

    edit_tensors(source, poison)
    quantize_refused(tmp_path, source, "--method", method, "--dataset", text_file, "--nsamples", 2, "--seqlen", 32,
                     words=["model.layers.1.mlp.up_proj.weight", "NaN/Inf"])


def test_missing_source_tensor(tmp_path, source):
    edit_tensors(source, lambda t: t.pop("model.layers.1.self_attn.q_proj.weight"))
    quantize_refused(tmp_path, source, words=["incomplete", "model.layers.1.self_attn.q_proj.weight"])


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupted_source_safetensors(tmp_path, source, damage):
    path = source / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64)
    quantize_refused(tmp_path, source, words=["truncated or corrupted"])


def test_overflowing_activations_name_the_layer(tmp_path, source, text_file):
    # finite weights whose activations overflow float32 inside block 0
    edit_tensors(source, lambda t: t["model.layers.0.post_attention_layernorm.weight"].fill_(3e38))
    quantize_refused(tmp_path, source, "--method", "gptq", "--dataset", text_file, "--nsamples", 2, "--seqlen", 32,
                     words=["model.layers.0", "NaN/Inf"])


def test_calibration_activations_larger_than_free_memory_are_refused_up_front(tmp_path, source, text_file,
                                                                               monkeypatch):
    import quantkit.calibration.sequential as sequential

    # 2 x 4 x 32 tokens x hidden 64 x 4 bytes = 64 KB of stored activations; pretend 50 KB are free
    monkeypatch.setattr(sequential, "free_bytes", lambda device: 50_000)
    quantize_refused(tmp_path, source, "--method", "gptq", "--dataset", text_file, "--nsamples", 4, "--seqlen", 32,
                     "--device", "cpu", words=["64.0 KiB (4 x 32 tokens x hidden size 64 x 4 bytes",
                                               "fewer --nsamples"])
    monkeypatch.setattr(sequential, "free_bytes", lambda device: 70_000)
    result = run("quantize", source, "-o", tmp_path / "out", "--group-size", 32, "--method", "gptq", "--dataset",
                 text_file, "--nsamples", 4, "--seqlen", 32, "--device", "cpu")
    assert result.exit_code == 0, result.output


def test_pickle_only_weights_are_refused(tmp_path, source, text_file):
    tensors = load_file(source / "model.safetensors")
    torch.save(tensors, source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    quantize_refused(tmp_path, source, words=["pickle", "pytorch_model.bin", "safetensors only"])
    assert_user_error(run("eval", "perplexity", source, "--dataset", text_file, "--device", "cpu"), "pickle")


REMOTE_CONFIG = """from transformers import LlamaConfig


class MyLlamaConfig(LlamaConfig):
    model_type = "my_llama"
"""
REMOTE_MODEL = """from transformers import LlamaForCausalLM

from .configuration_my import MyLlamaConfig


class MyLlamaForCausalLM(LlamaForCausalLM):
    config_class = MyLlamaConfig
"""


def test_model_code_runs_only_with_trust_remote_code(tmp_path, source, monkeypatch):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    (source / "configuration_my.py").write_text(REMOTE_CONFIG)
    (source / "modeling_my.py").write_text(REMOTE_MODEL)
    edit_json(source / "config.json", lambda c: c.update(model_type="my_llama", architectures=["MyLlamaForCausalLM"],
                                                          auto_map={"AutoConfig": "configuration_my.MyLlamaConfig",
                                                                    "AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"}))
    quantize_refused(tmp_path, source, words=["ships its own Python code", "--trust-remote-code"])
    result = run("quantize", source, "-o", tmp_path / "out", "--group-size", 32, "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_folder_without_its_tokenizer_is_named(tmp_path, source, text_file, checkpoint_dir):
    for folder in (source, checkpoint_dir):
        for f in folder.glob("*"):
            if f.name.startswith(("tokenizer", "special_tokens")):
                f.unlink()
    quantize_refused(tmp_path, source, "--method", "gptq", "--dataset", text_file, "--nsamples", 2, "--seqlen", 32,
                     words=["no tokenizer could be loaded", "tokenizer files"])
    for path in (source, checkpoint_dir):
        assert_user_error(run("eval", "perplexity", path, "--dataset", text_file, "--device", "cpu"),
                          "no tokenizer could be loaded")


def test_quantizing_a_quantized_checkpoint(tmp_path, checkpoint_dir):
    quantize_refused(tmp_path, checkpoint_dir, words=["already quantized"])


@pytest.mark.parametrize("size,words", [("4XB", ["'4XB' is not understood"]), ("0", ["'0' is not a positive size"]),
                                        ("0.1B", ["not a positive size"])])
def test_shard_sizes_are_checked(tmp_path, source, size, words):
    quantize_refused(tmp_path, source, "--max-shard-size", size, words=words)


@pytest.mark.parametrize("device", ["tpu", "mps", "meta", "cuda:x", "cpu:first"])
def test_unsupported_devices_are_named(tmp_path, source, text_file, device):
    quantize_refused(tmp_path, source, "--method", "gptq", "--dataset", text_file, "--nsamples", 2, "--seqlen", 32,
                     "--device", device, words=[f"--device {device} is not supported", "cpu, cuda, cuda:N"])
    assert_user_error(run("eval", "perplexity", source, "--dataset", text_file, "--device", device), "not supported")
    with pytest.raises(QuantkitError, match="not supported"):
        load_quantized(source, device_map=device)


def test_layers_a_quantizer_cannot_split_are_named_before_any_work_with_the_override_that_skips_them(tmp_path):
    from quantkit.demo import bundled_model_path

    src = bundled_model_path()  # stories260k: every mlp.down_proj has 172 inputs, not a multiple of E8's 8
    result = run("quantize", src, "-o", tmp_path / "out", "--method", "e8", "--bits", 2, "--group-size", 32)
    assert_user_error(result, "model.layers.0.mlp.down_proj (and 4 more layers)", "multiples of 8")
    assert "blocks" not in result.output and "e8:" not in result.output  # refused before the first block
    pattern = result.output.strip().splitlines()[-1].split("pattern: '")[1].split("'")[0]
    recipe = tmp_path / "skip.yaml"
    recipe.write_text(f"modules:\n  - pattern: '{pattern}'\n    skip: true\n")
    result = run("quantize", src, "-o", tmp_path / "out", "--method", "e8", "--bits", 2, "--group-size", 32,
                 "--recipe", recipe)
    assert result.exit_code == 0, result.output
    assert "30 quantized linears" in result.output


# --------------------------------------------------------------------------- windows past the model's context


@pytest.mark.parametrize("kind", ["gpt2", "llama"])  # a learned position table (an IndexError), RoPE (silent)
def test_windows_longer_than_the_context_are_refused(tmp_path, model_factory, text_file, kind):
    src = model_factory(kind)  # max_position_embeddings / n_positions 256
    quantize_refused(tmp_path, src, "--method", "gptq", "--dataset", text_file, "--nsamples", 2, "--seqlen", 300,
                     words=["--seqlen 300", "context of 256 tokens", "--seqlen 256 or less"])
    for command in (("eval", "perplexity", src), ("eval", "compare", src, "--base", src)):
        assert_user_error(run(*command, "--dataset", text_file, "--seqlen", 300, "--device", "cpu"),
                          "--seqlen 300", "context of 256")


def test_calibration_windows_given_to_the_api_are_checked_too(tmp_path, model_factory):
    from quantkit.api import quantize

    with pytest.raises(QuantkitError, match="calibration windows of 257 tokens .* context of 256"):
        quantize(str(model_factory("llama")), tmp_path / "out", QuantConfig(method="gptq", group_size=32),
                 device="cpu", calibration_ids=torch.zeros(2, 257, dtype=torch.long))
    assert not (tmp_path / "out").exists()


def test_token_ids_past_the_vocabulary_are_refused_before_any_block(tmp_path, model_factory):
    from quantkit.api import quantize

    src = model_factory("llama")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    with pytest.raises(QuantkitError, match=f"token id {vocab}, past the model's vocabulary of {vocab}"):
        quantize(str(src), tmp_path / "out", QuantConfig(method="gptq", group_size=32), device="cpu",
                 calibration_ids=torch.full((2, 16), vocab, dtype=torch.long))
    assert not (tmp_path / "out").exists()


def test_a_window_below_two_tokens_is_refused_before_anything_loads(tmp_path):
    # nothing at the model path and a hub dataset name: the option is what is named, at once
    for command in (("eval", "perplexity", tmp_path / "none"),
                    ("eval", "compare", tmp_path / "q", "--base", tmp_path / "b")):
        assert_user_error(run(*command, "--seqlen", 1), "--seqlen must be at least 2")


def no_loading(*args, **kwargs):
    raise AssertionError("the model was loaded before the dataset was checked")


def test_a_wrong_calibration_dataset_is_named_before_the_model_loads(tmp_path, source, monkeypatch):
    import quantkit.run.pipeline

    monkeypatch.setattr(quantkit.run.pipeline, "open_model", no_loading)
    quantize_refused(tmp_path, source, "--method", "gptq", "--dataset", source / "missing.txt",
                     words=["does not exist"])
    quantize_refused(tmp_path, source, "--method", "awq", "--dataset", "wikitext3", words=["unknown dataset"])


def test_a_wrong_eval_dataset_is_named_before_the_weights_load(source, checkpoint_dir, monkeypatch):
    import quantkit.eval

    monkeypatch.setattr(quantkit.eval, "load_any", no_loading)
    for command in (("eval", "perplexity", source), ("eval", "perplexity", checkpoint_dir),
                    ("eval", "compare", checkpoint_dir, "--base", source)):
        assert_user_error(run(*command, "--dataset", source / "missing.txt"), "does not exist")
        assert_user_error(run(*command, "--dataset", source), "is not a file")
        assert_user_error(run(*command, "--dataset", "wikitext3"), "unknown dataset")


def test_context_length_reads_the_config_and_its_rope_scaling():
    from transformers import GPT2Config, LlamaConfig, PretrainedConfig

    from quantkit.models.arch import context_length

    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "rope_theta": 500000.0}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    assert context_length(LlamaConfig(max_position_embeddings=4096)) == 4096
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}
    assert context_length(LlamaConfig(max_position_embeddings=4096, rope_parameters=linear)) == 16384
    assert context_length(LlamaConfig(max_position_embeddings=131072, rope_parameters=llama3)) == 131072
    assert context_length(LlamaConfig(max_position_embeddings=32768, rope_parameters=yarn)) == 131072
    assert context_length(GPT2Config(n_positions=1024)) == 1024
    assert context_length(PretrainedConfig()) is None and context_length(None) is None


# --------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("recipe,words", [
    ("modules:\n  - pattern: 'down_proj'\n    skip: 'false'\n", ["skip", "true or false"]),
    ("sym: 'no'\n", ["sym", "true or false"]),
    ("bits: '4'\n", ["bits", "whole number"]),
    ("bits: 4.0\n", ["bits", "whole number"]),
    ("nsamples: true\n", ["nsamples", "whole number"]),
    ("damp: 'high'\n", ["damp", "number"]),
    ("modules:\n  - pattern: 7\n    bits: 8\n", ["pattern", "string"]),
    ("modules: down_proj\n", ["modules", "list"]),
    ("modules:\n  - pattern: 'proj'\n    skip: true\n", ["skip all", "nothing to quantize"]),
])
def test_recipe_values_are_typed_strictly(tmp_path, source, recipe, words):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    quantize_refused(tmp_path, source, "--recipe", path, words=words)


def test_api_config_accepts_real_types_only():
    assert QuantConfig(damp=1).damp == 1.0 and QuantConfig(sym=False).sym is False
    with pytest.raises(QuantkitError, match="sym must be true or false"):
        QuantConfig(sym="false")


# --------------------------------------------------------------------------- quantized checkpoints


@pytest.fixture(scope="module")
def pristine_checkpoint(tmp_path_factory, model_factory):
    out = tmp_path_factory.mktemp("ckpt") / "q"
    result = run("quantize", model_factory("llama"), "-o", out, "--bits", 4, "--group-size", 32)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def checkpoint_dir(tmp_path, pristine_checkpoint):
    folder = tmp_path / "q"
    shutil.copytree(pristine_checkpoint, folder)
    return folder


LAYER = "model.layers.0.mlp.down_proj"  # 96 -> 64 with group size 32: 3 groups


def set_qc(**changes):
    def edit(config):
        qc = config["quantization_config"]
        for key, value in changes.items():
            if value is None:
                qc.pop(key, None)
            else:
                qc[key] = value
    return edit


def tensor_edit(fn):
    return lambda folder: edit_tensors(folder, fn)


def config_edit(fn):
    return lambda folder: edit_json(folder / "config.json", fn)


def _put(name, value):
    def edit(t):
        t[name] = value
    return edit


def _nan_scale(t):
    t[f"{LAYER}.scales"][1, 2] = float("nan")


TAMPERED = {
    # config.json's quantization_config alone: quantize_config.json would stand in for it (AutoGPTQ folders)
    "no quantization_config": (lambda folder: (config_edit(lambda c: c.pop("quantization_config"))(folder),
                                               (folder / "quantize_config.json").unlink()), ["quantization_config"]),
    "format key disagrees": (config_edit(set_qc(format="gptq_v2")), ["checkpoint_format 'gptq' but format 'gptq_v2'"]),
    "pack_dtype int16": (config_edit(set_qc(pack_dtype="int16")), ["pack_dtype 'int16'"]),
    "unknown format": (config_edit(set_qc(checkpoint_format="gptq_p")), ["checkpoint_format", "gptq_p"]),
    "v1 read as v2": (config_edit(set_qc(checkpoint_format="gptq_v2")), ["checkpoint_format", "written as 'gptq'"]),
    "v1 read as v2, no recipe": (lambda folder: (config_edit(set_qc(checkpoint_format="gptq_v2"))(folder),
                                                 (folder / "quantkit_recipe.yaml").unlink()),
                                 ["symmetric", "zero points decode to 7"]),
    "no bits": (config_edit(set_qc(bits=None)), ["no 'bits'"]),
    "no group_size": (config_edit(set_qc(group_size=None)), ["no 'group_size'"]),
    "bits 5": (config_edit(set_qc(bits=5)), ["bits 5"]),
    "bits as a string": (config_edit(set_qc(bits="4")), ["bits '4'"]),
    "group size 0": (config_edit(set_qc(group_size=0)), ["group_size 0"]),
    "group size -5": (config_edit(set_qc(group_size=-5)), ["group_size -5"]),
    "wrong group size": (config_edit(set_qc(group_size=64)), ["group size 64", "shape"]),
    "sym as a string": (config_edit(set_qc(sym="yes")), ["sym"]),
    "bad dynamic regex": (config_edit(set_qc(dynamic={"+:^model.(": {"bits": 8}})), ["not a valid regex"]),
    "dynamic bits 5": (config_edit(set_qc(dynamic={f"+:^{LAYER}$": {"bits": 5}})), ["bits 5"]),
    "dynamic excludes a packed layer": (config_edit(set_qc(dynamic={f"-:^{LAYER}$": {}})),
                                        [LAYER, "packed in the files", "contradict"]),
    "NaN scale": (tensor_edit(_nan_scale), [f"{LAYER}.scales", "NaN"]),
    "scales wrong shape": (tensor_edit(_put(f"{LAYER}.scales", torch.ones(2, 64, dtype=torch.float16))),
                           [f"{LAYER}.scales", "shape"]),
    "scales wrong dtype": (tensor_edit(_put(f"{LAYER}.scales", torch.ones(3, 64))), [f"{LAYER}.scales", "float16"]),
    "qzeros wrong shape": (tensor_edit(_put(f"{LAYER}.qzeros", torch.zeros(3, 4, dtype=torch.int32))),
                           [f"{LAYER}.qzeros", "shape"]),
    "g_idx wrong length": (tensor_edit(_put(f"{LAYER}.g_idx", torch.zeros(64, dtype=torch.int32))), [f"{LAYER}"]),
    "g_idx out of range": (tensor_edit(_put(f"{LAYER}.g_idx", torch.full((96,), 7, dtype=torch.int32))),
                           [f"{LAYER}.g_idx", "outside 0..2"]),
    "qzeros missing": (tensor_edit(lambda t: t.pop(f"{LAYER}.qzeros")), [LAYER, "qzeros"]),
    "config not JSON": (lambda folder: (folder / "config.json").write_text("{not json"), ["not valid JSON"]),
}


@pytest.mark.parametrize("case", TAMPERED)
@pytest.mark.parametrize("command", ["eval", "inspect", "load_quantized"])
def test_tampered_checkpoint_is_refused(checkpoint_dir, text_file, case, command):
    tamper, words = TAMPERED[case]
    tamper(checkpoint_dir)
    if command == "load_quantized":
        with pytest.raises(QuantkitError) as err:
            load_quantized(checkpoint_dir, device="cpu")
        for w in words:
            assert w in str(err.value), str(err.value)
        return
    if command == "inspect":
        result = run("inspect", checkpoint_dir)
    else:
        result = run("eval", "perplexity", checkpoint_dir, "--dataset", text_file, "--seqlen", 32,
                     "--max-tokens", 64, "--device", "cpu")
    if case == "no quantization_config" and command == "eval":
        words = ["packed quantized tensors", "quantization_config"]  # eval would take it for an fp model
    assert_user_error(result, *words)


def test_asymmetric_format_swap_is_caught_by_the_recipe(tmp_path, model_factory):
    out = tmp_path / "q"
    assert run("quantize", model_factory("llama"), "-o", out, "--asym", "--group-size", 32).exit_code == 0
    edit_json(out / "config.json", set_qc(checkpoint_format="gptq_v2"))
    assert_user_error(run("inspect", out), "checkpoint_format", "'gptq'")


def test_pristine_checkpoint_passes(checkpoint_dir, text_file):
    assert run("inspect", checkpoint_dir).exit_code == 0
    result = run("eval", "perplexity", checkpoint_dir, "--dataset", text_file, "--seqlen", 32, "--max-tokens", 64,
                 "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output

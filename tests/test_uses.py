"""The families of 2025-26, by what each weight does in the forward (quantkit.models.uses): hybrid linear-attention
stacks whose conv kernels are not experts, routers whatever they are called, linears the model's own code reads,
Gemma 4's per-layer inputs and attention types, and the MTP tensors transformers does not load, carried byte for
byte. Tiny random models from transformers' own config classes."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import quantkit
from tiny_models import save_random
from test_quantizers import calibration, capture_results, in_loop_logits

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, pad_token_id=0)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def config(family):
    import transformers as T

    return {
        # three Gated DeltaNet layers (a depthwise conv1d, A_log, dt_bias), then one attention layer; every MLP a MoE
        # layer with a shared expert behind a one-output sigmoid gate
        "qwen3_next": lambda: T.Qwen3NextConfig(**TEXT, **MOE, num_hidden_layers=4, head_dim=16, num_experts=4,
                                                shared_expert_intermediate_size=32, linear_num_value_heads=4,
                                                linear_num_key_heads=2, linear_key_head_dim=16,
                                                linear_value_head_dim=16),
        # MLA with the lightning indexer, whose weights_proj the attention reads as .weight.dtype
        "deepseek_v32": lambda: T.DeepseekV32Config(**{**TEXT, "num_key_value_heads": 4}, **MOE, num_hidden_layers=2,
                                                    n_routed_experts=4, n_group=1, topk_group=1, kv_lora_rank=16,
                                                    q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                    v_head_dim=16, first_k_dense_replace=1, index_n_heads=4,
                                                    index_head_dim=16, index_topk=8),
        # a router named mlp.gate.wg, whose weight its module reads
        "hunyuan_v1_moe": lambda: T.HunYuanMoEV1Config(**TEXT, num_hidden_layers=2, head_dim=16, num_experts=4,
                                                       moe_topk=2),
        # per-layer inputs (a positional argument of each block), sliding and full attention with their own RoPE
        "gemma4_text": lambda: T.Gemma4TextConfig(**TEXT, num_hidden_layers=4, head_dim=16,
                                                  hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                                                  sliding_window=16, layer_types=["sliding_attention"] * 3 +
                                                  ["full_attention"]),
    }[family]()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("uses"), {}

    def make(family):
        if family not in made:
            made[family] = save_random(config(family), root / family)
        return made[family]

    return make


def traced(src):
    from quantkit.calibration.capture import trace_blocks
    from quantkit.models.arch import arch_for
    from quantkit.models.stream import open_model

    source, _, _ = open_model(str(src), "float32", tokenizer_required=False)
    return trace_blocks(source, arch_for(source.model), "cpu")


def test_a_hybrid_stack_keeps_its_conv_kernels_and_routers_in_float_and_quantizes_the_rest(sources):
    uses = traced(sources("qwen3_next"))
    linear_attention, attention = uses[0], uses[3]
    assert linear_attention.kinds == {"linear_attn.conv1d.weight": "conv", "mlp.gate.weight": "router",
                                      "mlp.shared_expert_gate.weight": "router"}
    # stages by dependency: the input projections, then out_proj; the experts' gate/up, then their down
    assert linear_attention.stages[:2] == (("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"),
                                           ("linear_attn.out_proj",))
    assert set(linear_attention.stages[3]) == {f"mlp.experts.{e}.down_proj" for e in range(4)} | {
        "mlp.shared_expert.down_proj"}
    assert attention.stages[:2] == (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",))
    assert "linear_attn.conv1d.weight" not in attention.kinds


@pytest.mark.parametrize("family,kept", [
    ("deepseek_v32", {"model.layers.0.self_attn.indexer.weights_proj.weight": "read",
                      "model.layers.1.self_attn.indexer.weights_proj.weight": "read",
                      "model.layers.1.mlp.gate.weight": "router"}),
    ("hunyuan_v1_moe", {"model.layers.0.mlp.gate.wg.weight": "router", "model.layers.1.mlp.gate.wg.weight": "router"}),
])
def test_what_the_model_reads_or_routes_with_stays_in_float_and_the_checkpoint_runs(sources, tmp_path, family, kept):
    """Both crashed in transformers' forward once quantized ('QuantLinear' object has no attribute 'weight')."""
    src, ids = sources(family), calibration()
    report = quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(group_size=32), calibration_ids=ids)
    coverage = report["coverage"]
    assert {n: kind for kind in ("read", "router") for n in coverage.get(kind, [])} == kept
    assert not set(report["layers"]) & {n.removesuffix(".weight") for n in kept}
    assert "in floating point:" in coverage["summary"] and "router" in coverage["summary"]
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    with torch.inference_mode():
        assert torch.isfinite(model(ids).logits).all()


def test_every_block_gets_the_arguments_the_model_gives_it(sources):
    """Gemma 4: block i's per-layer input is slice i (a positional argument), and the full-attention block's position
    embeddings are its own (another head dim) where block 0's were reused before."""
    from quantkit.calibration.capture import capture_block_calls
    from quantkit.models.arch import arch_for
    from quantkit.models.hub import load_fp_model

    model, _ = load_fp_model(str(sources("gemma4_text")), "float32")
    ids = calibration()[:2]
    captured = capture_block_calls(model, arch_for(model), ids, "cpu")
    per_layer = model.model.project_per_layer_inputs(model.model.embed_tokens(ids[:1]),
                                                     model.model.get_per_layer_inputs(ids[:1]))
    for i in range(4):
        args, kwargs = captured.calls[0][i]
        torch.testing.assert_close(args[0], per_layer[:, :, i, :])
    sliding, full = captured.calls[0][0][1]["position_embeddings"], captured.calls[0][3][1]["position_embeddings"]
    assert sliding[0].shape != full[0].shape
    assert captured.calls[1][0][1]["position_embeddings"][0] is sliding[0]  # equal in every sample: held once


@pytest.mark.parametrize("family", ["gemma4_text", "qwen3_next"])
def test_quantize_write_load_gives_the_in_loop_logits(sources, tmp_path, monkeypatch, family):
    src, ids = sources(family), calibration()
    results = capture_results(monkeypatch)
    report = quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(method="gptq", group_size=32),
                               calibration_ids=ids)
    assert len(report["layers"]) == len(results) and report["coverage"]["quantized_share"] > 0.6
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    with torch.inference_mode():
        got = model(ids).logits
    torch.testing.assert_close(got, in_loop_logits(src, results, ids), rtol=1e-4, atol=1e-4)


def with_mtp(src, folder, extra: dict, config_fields: dict):
    """A copy of `src` whose files also hold `extra` (as releases ship their MTP layers) and whose config.json
    declares them."""
    shutil.copytree(src, folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config_fields}))
    return folder


@pytest.mark.parametrize("layout", ["mtp", "next_layer"])
def test_tensors_the_model_does_not_load_are_carried_byte_for_byte(sources, tmp_path, layout):
    """Qwen3-Next's mtp.* and GLM-4.5 / DeepSeek-V3's model.layers.N (N = num_hidden_layers): transformers drops
    both on load; the checkpoint keeps them, the summary names them, and the model loads back."""
    gen = torch.Generator().manual_seed(1)
    prefix = "mtp." if layout == "mtp" else "model.layers.4."
    extra = {f"{prefix}eh_proj.weight": torch.randn(64, 128, generator=gen).to(torch.bfloat16),
             f"{prefix}mlp.down_proj.weight": torch.randn(64, 96, generator=gen).to(torch.bfloat16),
             f"{prefix}enorm.weight": torch.ones(64, dtype=torch.float32)}
    src = with_mtp(sources("qwen3_next"), tmp_path / "src", extra, {"mtp_num_hidden_layers": 1})
    report = quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(method="rtn", group_size=32))
    assert report["carried"] == sorted(extra)
    assert report["coverage"]["summary"].endswith(f"carried over unchanged: 3 tensors the model does not load "
                                                  f"({prefix}*)")
    with safe_open(tmp_path / "q" / "model.safetensors", framework="pt") as f:
        for name, t in extra.items():
            assert f.get_tensor(name).dtype == t.dtype and torch.equal(f.get_tensor(name), t)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    assert not any(n.startswith(prefix) for n in model.state_dict())


def test_load_quantized_takes_device_or_device_map_as_from_pretrained_does(sources, tmp_path):
    quantkit.quantize(str(sources("hunyuan_v1_moe")), tmp_path / "q", quantkit.QuantConfig(method="rtn", group_size=32))
    assert next(quantkit.load_quantized(tmp_path / "q", device=torch.device("cpu")).parameters()).device.type == "cpu"
    with pytest.raises(quantkit.QuantkitError, match="give one of them"):
        quantkit.load_quantized(tmp_path / "q", device="cpu", device_map="cuda:0")


def test_the_trace_reads_one_block_of_each_kind(sources, monkeypatch):
    """Qwen3-Next's three linear-attention blocks are alike: the first is traced, the other two stand in; the
    attention block is of another kind and is traced too. Every block still gets its uses."""
    from quantkit.calibration.capture import trace_blocks
    from quantkit.models.arch import arch_for
    from quantkit.models.stream import StreamedModel, open_model

    read = []
    original = StreamedModel.read

    def counting(self, names, dtype=None):
        read.extend(names)
        return original(self, names, dtype)

    monkeypatch.setattr(StreamedModel, "read", counting)
    source, _, _ = open_model(str(sources("qwen3_next")), "float32", tokenizer_required=False)
    uses = trace_blocks(source, arch_for(source.model), "cpu")
    weights = {n.split(".")[2] for n in read if n.startswith("model.layers.") and n.endswith("proj.weight")}
    assert weights == {"0", "3"}
    assert uses[1] == uses[0] and uses[2] == uses[0] and uses[3] != uses[0]


def test_block_weights_the_model_rewrites_outside_the_blocks_stay_in_float_and_as_stored():
    """RWKV's forward divides its blocks' attention.output and feed_forward.value weights by 2^(i // rescale_every)
    in place at its first eval call, outside every block's forward: the trace sees it (kind "read", no linear to
    quantize) and does not let it happen to the source, an in-memory one too, whose weights the checkpoint holds."""
    from transformers import RwkvConfig, RwkvForCausalLM

    from quantkit.calibration.capture import trace_blocks
    from quantkit.models.arch import arch_for
    from quantkit.models.stream import InMemoryModel

    torch.manual_seed(0)
    model = RwkvForCausalLM(RwkvConfig(vocab_size=512, hidden_size=32, attention_hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, rescale_every=1)).eval()
    before = model.rwkv.blocks[1].attention.output.weight.clone()
    uses = trace_blocks(InMemoryModel(model, "rwkv"), arch_for(model), "cpu")
    rescaled = ("attention.output", "feed_forward.value")
    assert all(u.kinds[f"{n}.weight"] == "read" and n not in u.linears for u in uses for n in rescaled)
    assert {"attention.key", "feed_forward.key"} <= uses[1].linears
    assert torch.equal(model.rwkv.blocks[1].attention.output.weight, before)

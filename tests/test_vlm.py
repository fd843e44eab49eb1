"""Vision-language models: the language model's decoder blocks are quantized with text calibration, the vision tower
and projector stay in floating point, and the folder loads back as the same class with the vision weights as they
were."""
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

import quantkit
from quantkit.checkpoint.files import read_tensors
from quantkit.demo import bundled_model_path
from quantkit.models.hub import load_fp_model
from test_quantizers import calibration, capture_results, in_loop_logits

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def qwen2_5_vl():
    """A deeper vision tower (3 blocks) than language model (2): the blocks must still be the language model's."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config=dict(**TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                            vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                                               out_hidden_size=64))


def gemma3():
    from transformers import Gemma3Config

    return Gemma3Config(text_config=dict(**TEXT, head_dim=16), mm_tokens_per_image=4,
                        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                           num_attention_heads=2, image_size=32, patch_size=8))


def llama4():
    """Llama 4: the MoE language model (router-scaled experts) beside its vision model."""
    from transformers import Llama4Config

    return Llama4Config(text_config=dict(**{**TEXT, "intermediate_size": 32}, intermediate_size_mlp=96, head_dim=16,
                                         num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14, vision_output_dim=64,
                                           projector_input_dim=64, projector_output_dim=64))


@pytest.mark.parametrize("config,method,linears", [(qwen2_5_vl, "gptq", 14), (gemma3, "rtn", 14), (gemma3, "awq", 14),
                                                   (llama4, "gptq", 26)])
def test_the_language_model_is_quantized_and_the_vision_tower_kept(tmp_path, monkeypatch, config, method, linears):
    torch.manual_seed(0)
    fp = AutoModelForImageTextToText.from_config(config())
    with torch.no_grad():
        for p in fp.parameters():
            if p.dim() > 1 and not p.abs().sum():
                p.normal_(0, 0.02)  # from_config leaves Llama 4's expert tensors at zero
    fp.save_pretrained(tmp_path / "src")
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(tmp_path / "src")
    ids = calibration()
    results = capture_results(monkeypatch)
    report = quantkit.quantize(str(tmp_path / "src"), tmp_path / "q", quantkit.QuantConfig(method=method,
                                                                                          group_size=32),
                               calibration_ids=ids)
    assert len(report["layers"]) == linears and all(".layers." in n and "vis" not in n for n in report["layers"])
    outside = report["coverage"]["outside"]
    assert outside and all("vision" in n or "visual" in n or "multi_modal" in n for n in outside)
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    fp, _ = load_fp_model(str(tmp_path / "src"), "float32")
    assert type(model) is type(fp) and type(model).__name__.endswith("ForConditionalGeneration")
    vision = {n: p for n, p in fp.named_parameters() if "vis" in n or "multi_modal" in n}
    loaded = dict(model.named_parameters())
    assert vision and all(torch.equal(loaded[n], p) for n, p in vision.items())  # untouched, bit for bit
    # the float tensors keep the names transformers saved them under (Gemma 3's language_model.model.*)
    source_names, written = set(read_tensors(tmp_path / "src")), set(read_tensors(tmp_path / "q"))
    assert {n for n in source_names if "vis" in n or "multi_modal" in n} <= written
    assert any(n.endswith("embed_tokens.weight") for n in source_names & written)
    if config is llama4:
        return  # transformers 5.24's Llama4ForConditionalGeneration cannot run text alone (no image_outputs)
    with torch.inference_mode():
        got = model(ids).logits
    folded = {n: p for n, p in model.named_parameters() if "norm" in n}  # AWQ's scales, folded into the norms
    torch.testing.assert_close(got, in_loop_logits(tmp_path / "src", results, ids, folded), rtol=1e-4, atol=1e-4)

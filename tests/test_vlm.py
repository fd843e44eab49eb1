"""Vision-language models: the language model's decoder blocks are quantized with text calibration, the vision tower
and projector stay in floating point, and the folder loads back as the same class with the vision weights as they
were."""
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

import quantkit
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


@pytest.mark.parametrize("config,method", [(qwen2_5_vl, "gptq"), (gemma3, "rtn")])
def test_the_language_model_is_quantized_and_the_vision_tower_kept(tmp_path, monkeypatch, config, method):
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config()).save_pretrained(tmp_path / "src")
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(tmp_path / "src")
    ids = calibration()
    results = capture_results(monkeypatch)
    report = quantkit.quantize(str(tmp_path / "src"), tmp_path / "q", quantkit.QuantConfig(method=method,
                                                                                          group_size=32),
                               calibration_ids=ids)
    assert len(report["layers"]) == 14 and all(".language_model.layers." in n for n in report["layers"])
    outside = report["coverage"]["outside"]
    assert outside and all("vision" in n or "visual" in n or "multi_modal" in n for n in outside)
    model = quantkit.load_quantized(tmp_path / "q")
    fp, _ = load_fp_model(str(tmp_path / "src"), "float32")
    assert type(model) is type(fp) and type(model).__name__.endswith("ForConditionalGeneration")
    vision = {n: p for n, p in fp.named_parameters() if "vis" in n or "multi_modal" in n}
    loaded = dict(model.named_parameters())
    assert vision and all(torch.equal(loaded[n], p) for n, p in vision.items())  # untouched, bit for bit
    with torch.inference_mode():
        got = model(ids).logits
    torch.testing.assert_close(got, in_loop_logits(tmp_path / "src", results, ids), rtol=1e-4, atol=1e-4)

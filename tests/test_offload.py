"""Streamed models (issue 17, quantkit.models.offload): blocks read from the files as they run, the same logits as the
model held whole, nothing left loaded after a forward (also one that fails), clear errors for incomplete files."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantkit.api import quantize
from quantkit.cli import main
from quantkit.run.config import QuantConfig
from quantkit.core.errors import QuantkitError
from quantkit.eval import load_any
from quantkit.run.load import load_quantized

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 41, 3, 8, 60, 12]])


@pytest.fixture(scope="module")
def quantized(model_factory, tmp_path_factory):
    """{kind: quantized folder}: an untied head (streamed) and a tied one with biases (the head stays resident)."""
    root = tmp_path_factory.mktemp("offload")
    out = {}
    for kind in ("llama", "llama-tied-bias"):
        out[kind] = root / kind
        quantize(str(model_factory(kind)), out[kind], QuantConfig(method="rtn", group_size=32), device="cpu")
    return out


def block_tensors(model):
    return [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if ".layers." in n]


def logits(model, ids=IDS):
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("kind", ["llama", "llama-tied-bias"])
def test_streamed_quantized_model_equals_the_loaded_one_and_holds_no_block_after(quantized, kind):
    whole = load_quantized(quantized[kind], device="cpu")
    streamed = load_quantized(quantized[kind], device="cpu", stream=True)
    assert all(t.is_meta for _, t in block_tensors(streamed))
    assert torch.equal(logits(streamed), logits(whole))
    assert torch.equal(logits(streamed), logits(whole))  # again: the second read gives the same tensors
    assert all(t.is_meta for _, t in block_tensors(streamed))
    assert streamed.lm_head.weight.is_meta == (kind == "llama")  # a tied head is the resident embedding
    assert streamed.device == torch.device("cpu")
    with torch.inference_mode():
        a = whole.generate(IDS[:, :4], max_new_tokens=5, do_sample=False)
        b = streamed.generate(IDS[:, :4], max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["llama-tied-bias", "opt", "gpt2"])
def test_streamed_fp_model_equals_the_loaded_one(model_factory, kind):
    folder = model_factory(kind)
    whole, _ = load_any(str(folder), "cpu")
    streamed, _ = load_any(str(folder), "cpu", stream=True)
    assert any(t.is_meta for t in streamed.parameters())
    assert torch.equal(logits(streamed), logits(whole))


def test_a_failing_forward_still_drops_the_block(quantized):
    model = load_quantized(quantized["llama"], stream=True, device="cpu")
    attn = model.model.layers[1].self_attn

    def fail(module, args):
        raise RuntimeError("boom")

    handle = attn.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        logits(model)
    assert all(t.is_meta for _, t in block_tensors(model))
    handle.remove()
    assert torch.equal(logits(model), logits(load_quantized(quantized["llama"], device="cpu")))


def test_a_tensor_missing_from_the_files_is_named(quantized, tmp_path):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(quantized["llama"], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match="model.layers.1.post_attention_layernorm.weight"):
        load_quantized(folder, stream=True, device="cpu")


def test_cli_perplexity_stream_gives_the_same_numbers(quantized, model_factory, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"Once upon a time there was a little cat number {i} who liked to play." for i in range(60)))
    for path in (quantized["llama"], model_factory("llama")):
        runs = [CliRunner().invoke(main, ["eval", "perplexity", str(path), "--dataset", str(text), "--seqlen", "32",
                                          "--max-tokens", "128", "--device", "cpu", "--json", *flag])
                for flag in ([], ["--stream"])]
        assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
        plain, streamed = (json.loads(r.output[r.output.rindex("{"):]) for r in runs)  # after any progress bar
        assert streamed == plain

"""quantkit.eval.perplexity against hand computations."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import quantkit
from quantkit.core.errors import QuantkitError
from quantkit.eval import perplexity

VOCAB = 512
STORIES_DIR = Path(quantkit.__file__).parent / "assets" / "stories260k"


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def random_stream(n_tokens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n_tokens), generator=generator)


def reference_perplexity(model, input_ids, seqlen):
    """The GPTQ eval loop, written out: one window at a time, mean loss per window, exp of the mean."""
    n_windows = input_ids.shape[1] // seqlen
    window_losses = []
    with torch.no_grad():
        for i in range(n_windows):
            window = input_ids[:, i * seqlen : (i + 1) * seqlen]
            logits = model(window).logits
            window_losses.append(F.cross_entropy(logits[0, :-1].float(), window[0, 1:]))
    return math.exp(torch.stack(window_losses).mean().item())


@pytest.mark.parametrize("batch_size", [1, 3])
def test_matches_hand_computation(tiny_llama, batch_size):
    input_ids = random_stream(5 * 16 + 7)  # 5 full windows + a partial one that must be dropped
    result = perplexity(tiny_llama, input_ids, seqlen=16, batch_size=batch_size, progress=False)
    assert result["windows"] == 5
    assert result["tokens"] == 5 * 15
    assert result["seqlen"] == 16
    assert result["ppl"] == pytest.approx(reference_perplexity(tiny_llama, input_ids, 16), rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(result["nll"]), rel=1e-12)


def test_loss_chunking_does_not_change_the_result(tiny_llama, monkeypatch):
    from quantkit import eval as eval_module

    input_ids = random_stream(3 * 32, seed=1)
    whole = perplexity(tiny_llama, input_ids, seqlen=32, progress=False)
    monkeypatch.setattr(eval_module, "_LOSS_CHUNK", 5)  # 31 predictions -> chunks of 5,5,...,1
    chunked = perplexity(tiny_llama, input_ids, seqlen=32, progress=False)
    assert chunked["ppl"] == pytest.approx(whole["ppl"], rel=1e-6)


class UniformLM(torch.nn.Module):
    """Predicts every token with the same probability: perplexity must be exactly the vocab size."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # gives the module a device

    def forward(self, input_ids, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.vocab, dtype=torch.bfloat16) + self.anchor.to(torch.bfloat16)
        return SimpleNamespace(logits=logits)


def test_uniform_logits_give_vocab_size():
    result = perplexity(UniformLM(VOCAB), random_stream(4 * 8), seqlen=8, batch_size=2, progress=False)
    assert result["ppl"] == pytest.approx(VOCAB, rel=1e-6)
    assert result["nll"] == pytest.approx(math.log(VOCAB), rel=1e-6)
    assert (result["windows"], result["tokens"]) == (4, 4 * 7)


def test_text_shorter_than_one_window(tiny_llama):
    with pytest.raises(QuantkitError) as err:
        perplexity(tiny_llama, random_stream(10), seqlen=16, progress=False)
    message = str(err.value)
    assert "only 10 tokens" in message and "--seqlen 16" in message and "smaller --seqlen" in message


@pytest.mark.parametrize("seqlen,batch_size,match", [(1, 1, "--seqlen must be at least 2"), (8, 0, "--batch-size must be at least 1")])
def test_bad_options(tiny_llama, seqlen, batch_size, match):
    with pytest.raises(QuantkitError, match=match):
        perplexity(tiny_llama, random_stream(32), seqlen=seqlen, batch_size=batch_size, progress=False)


def test_restores_training_mode(tiny_llama):
    tiny_llama.train()
    try:
        perplexity(tiny_llama, random_stream(32), seqlen=16, progress=False)
        assert tiny_llama.training
    finally:
        tiny_llama.eval()


def test_pretrained_stories_model_on_a_story(tmp_path):
    """End to end through quantkit.calibration.data: the real tiny model finds a children's story predictable."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.eval import eval_ids

    story = tmp_path / "story.txt"
    story.write_text(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.\n"
        "One day, she saw a big red ball in the park. She ran to the ball and picked it up.\n"
        "Lily was very happy. She played with the ball all day long. Then she went home to her mom.\n",
        encoding="utf-8",
    )
    tokenizer = AutoTokenizer.from_pretrained(STORIES_DIR)
    model = AutoModelForCausalLM.from_pretrained(STORIES_DIR)
    result = perplexity(model, eval_ids(tokenizer, str(story)), seqlen=32, progress=False)
    assert result["windows"] >= 2
    assert 1.0 < result["ppl"] < 20.0  # a random model sits near the vocab size (512)

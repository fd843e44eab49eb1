"""quantkit eval compare: KL divergence, top-1 agreement and Δp against the base model; per-layer fidelity."""
import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.compare import (check_same_tokenizer, compare_low_memory, compare_models, first_divergence,
                              position_stats, summarize)
from quantkit.core.errors import QuantkitError
from quantkit.algorithms.hessian import fidelity
from quantkit.models.hub import load_fp_model
from quantkit.run.report import flag_outliers

VOCAB = 7


class TableLM(torch.nn.Module):
    """Logits are a fixed row of a table per input token: every figure can be computed by hand."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(logits=self.table[input_ids])


def tables(seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(VOCAB, VOCAB, generator=gen) * 2
    return base, base + 0.7 * torch.randn(VOCAB, VOCAB, generator=gen)


def stream(n, seed=0):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def numpy_reference(base_table, quant_table, ids, seqlen):
    """The figures straight from the definition, in float64 numpy."""
    def logsoftmax(x):
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    b, q = logsoftmax(base_table.double().numpy()), logsoftmax(quant_table.double().numpy())
    kld, top1, dp, nll_b, nll_q = [], [], [], [], []
    s = ids[0, : ids.shape[1] // seqlen * seqlen].numpy().reshape(-1, seqlen)
    for w in s:
        for t in range(seqlen - 1):
            pb, pq = b[w[t]], q[w[t]]
            kld.append(float((np.exp(pb) * (pb - pq)).sum()))
            top1.append(float(pb.argmax() == pq.argmax()))
            dp.append(float(np.exp(pq[pb.argmax()]) - np.exp(pb[pb.argmax()])))
            nll_b.append(-pb[w[t + 1]])
            nll_q.append(-pq[w[t + 1]])
    return np.array(kld), np.array(top1), np.array(dp), math.exp(np.mean(nll_b)), math.exp(np.mean(nll_q))


def test_hand_computable_logits_match_numpy():
    base_table, quant_table = tables()
    ids = stream(5 * 16 + 3)
    got = compare_models(TableLM(base_table), TableLM(quant_table), ids, 16, progress=False)
    kld, top1, dp, ppl_b, ppl_q = numpy_reference(base_table, quant_table, ids, 16)
    assert got["tokens"] == kld.size == 5 * 15 and got["windows"] == 5
    assert got["kld"]["mean"] == pytest.approx(kld.mean(), rel=1e-5)
    assert got["kld"]["max"] == pytest.approx(kld.max(), rel=1e-5)
    assert got["top1"]["mean"] == pytest.approx(top1.mean(), abs=1e-12)
    assert got["delta_p"]["mean"] == pytest.approx(dp.mean(), rel=1e-5, abs=1e-7)
    assert got["ppl"]["base"] == pytest.approx(ppl_b, rel=1e-5) and got["ppl"]["quant"] == pytest.approx(ppl_q, rel=1e-5)
    assert got["ppl"]["delta"] == pytest.approx(ppl_q - ppl_b, rel=1e-4)


def test_summaries_match_numpy_on_random_data():
    v = np.random.default_rng(0).gamma(0.5, 0.2, size=10_001)
    s = summarize(v)
    assert s["mean"] == pytest.approx(v.mean()) and s["max"] == v.max()
    assert s["stderr"] == pytest.approx(v.std(ddof=1) / math.sqrt(v.size))
    for key, q in (("median", 50), ("p90", 90), ("p99", 99), ("p999", 99.9)):
        assert s[key] == pytest.approx(np.percentile(v, q))


@pytest.fixture(scope="module")
def tiny(model_factory):
    model, tokenizer = load_fp_model(str(model_factory("llama")), "float32")
    return model, tokenizer


def test_model_against_itself_is_exactly_zero(tiny):
    model, _ = tiny
    got = compare_models(model, model, stream(3 * 32, seed=2) % 512, 32, progress=False)
    assert got["kld"]["max"] == 0.0 and got["kld"]["mean"] == 0.0
    assert got["top1"]["mean"] == 1.0 and got["delta_p"]["mean"] == 0.0 and got["ppl"]["delta"] == 0.0


def test_low_memory_gives_the_direct_numbers(tmp_path):
    base_table, quant_table = tables(1)
    ids = stream(4 * 16, seed=3)
    direct = compare_models(TableLM(base_table), TableLM(quant_table), ids, 16, progress=False)
    seen = []
    low = compare_low_memory(lambda: TableLM(base_table), lambda: TableLM(quant_table), ids, 16, cache_dir=tmp_path,
                             progress=False, visit=lambda role, model: seen.append(role))
    assert low == direct and seen == ["base", "quant"]
    assert list(tmp_path.iterdir()) == []  # the cache is gone


def test_vocabulary_and_tokenizer_mismatch_are_refused(tiny):
    with pytest.raises(QuantkitError, match="different vocabularies"):
        position_stats(torch.zeros(3, 5), torch.zeros(3, 6), torch.zeros(3, dtype=torch.long))
    _, tokenizer = tiny
    other = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    other.add_tokens(["<an-extra-token>"])
    with pytest.raises(QuantkitError, match="different tokenizers"):
        check_same_tokenizer(tokenizer, other)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "eval.txt"
    path.write_text("\n".join(f"Once upon a time a cat called number {i} sat on a mat." for i in range(120)))
    return path


def test_cli_compare(model_factory, tmp_path, text_file):
    src = model_factory("llama")
    out = tmp_path / "q"
    assert CliRunner().invoke(main, ["quantize", str(src), "-o", str(out), "--bits", "3", "--group-size", "32"]).exit_code == 0
    args = ["eval", "compare", str(out), "--base", str(src), "--dataset", str(text_file), "--seqlen", "32",
            "--max-tokens", "256", "--device", "cpu", "--prompts", "Once upon a time", "--max-new-tokens", "8"]
    result = CliRunner().invoke(main, args + ["--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["kld"]) == {"mean", "stderr", "median", "p90", "p99", "p999", "max"}
    assert 0 < data["kld"]["mean"] and 0 <= data["top1"]["mean"] <= 1 and data["tokens"] == 8 * 31
    assert len(data["generations"]) == 1 and data["generations"][0]["prompt"] == "Once upon a time"
    low = CliRunner().invoke(main, args + ["--json", "--low-memory", "--cache-dir", str(tmp_path)])
    assert json.loads(low.stdout) == data
    text = CliRunner().invoke(main, args)
    assert "KL divergence" in text.output and "top-1 agreement" in text.output and "quantized:" in text.output
    assert "warning" not in text.stderr
    # a continuation past the context (256) is refused before any work, a missing cache folder by name
    too_long = args[:-1] + ["256"]
    refused = CliRunner().invoke(main, too_long)
    assert refused.exit_code == 2 and "--max-new-tokens 256" in refused.output and "context of 256" in refused.output
    missing = CliRunner().invoke(main, args + ["--low-memory", "--cache-dir", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "does not exist" in missing.output and "Traceback" not in missing.output
    # a base of another shape (same tokenizer) runs, with a warning naming what differs
    unrelated = args[:4] + [str(model_factory("llama-deep"))] + args[5:]
    warned = CliRunner().invoke(main, unrelated)
    assert warned.exit_code == 0, warned.output
    assert "warning: " in warned.stderr and "num_hidden_layers 2 vs 4" in warned.stderr
    # a base model with another tokenizer is refused
    other = tmp_path / "other"
    shutil.copytree(src, other)
    config = json.loads((other / "tokenizer.json").read_text())
    config["model"]["vocab"]["<zzz-new>"] = len(config["model"]["vocab"])
    (other / "tokenizer.json").write_text(json.dumps(config))
    refused = CliRunner().invoke(main, ["eval", "compare", str(out), "--base", str(other), "--dataset", str(text_file)])
    assert refused.exit_code == 2 and "different tokenizers" in refused.output


def test_compare_defaults_to_the_model_the_checkpoint_was_made_from(model_factory, tmp_path, text_file, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(model_factory("llama"), src)
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(main, ["quantize", "src", "-o", "q", "--bits", "3", "--group-size", "32"]).exit_code == 0
    monkeypatch.chdir(tmp_path / "q")  # the relative "src" would now miss: the report holds the absolute path
    args = ["eval", "compare", str(tmp_path / "q"), "--dataset", str(text_file), "--seqlen", "32", "--max-tokens",
            "128", "--device", "cpu", "--json"]
    recorded = CliRunner().invoke(main, args)
    assert recorded.exit_code == 0, recorded.output
    assert json.loads(recorded.stdout) == json.loads(CliRunner().invoke(main, args + ["--base", str(src)]).stdout)
    # a converted checkpoint names the same source
    ct = ["convert", str(tmp_path / "q"), "-o", str(tmp_path / "ct"), "--checkpoint-format", "compressed-tensors"]
    assert CliRunner().invoke(main, ct).exit_code == 0
    converted = CliRunner().invoke(main, [*args[:2], str(tmp_path / "ct"), *args[3:]])
    assert converted.exit_code == 0, converted.output
    # the source moved, or a checkpoint that names none: one line that says to pass --base
    src.rename(tmp_path / "moved")
    gone = CliRunner().invoke(main, args)
    assert gone.exit_code == 2 and "no longer there: pass --base" in gone.output and "Traceback" not in gone.output
    (tmp_path / "q" / "quantkit_report.json").unlink()
    unnamed = CliRunner().invoke(main, args)
    assert unnamed.exit_code == 2 and "does not name the model" in unnamed.output and "--base" in unnamed.output
    missing = CliRunner().invoke(main, ["eval", "compare", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "not a local folder" in missing.output and "--base" in missing.output
    floating = CliRunner().invoke(main, ["eval", "compare", str(tmp_path / "moved")])  # the fp source as QUANT
    assert floating.exit_code == 2 and "is not a quantized checkpoint" in floating.output, floating.output


def test_fidelity_from_the_hessian_equals_the_outputs():
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(12, 40, generator=gen, dtype=torch.float64)
    W_hat = W + 0.1 * torch.randn(12, 40, generator=gen, dtype=torch.float64)
    X = torch.randn(40, 300, generator=gen, dtype=torch.float64)
    f = fidelity(W, W_hat, 2 * X @ X.t() / 300)
    y, y_hat = (W @ X).flatten(), (W_hat @ X).flatten()
    assert f["cosine"] == pytest.approx(float(y @ y_hat / (y.norm() * y_hat.norm())), rel=1e-12)
    assert f["sqnr_db"] == pytest.approx(float(10 * torch.log10(y.pow(2).sum() / (y - y_hat).pow(2).sum())), rel=1e-12)


def test_outlier_layers_are_flagged():
    layers = {f"model.layers.{i}.mlp.down_proj": {"sqnr_db": 20.0 + 0.5 * i} for i in range(5)}
    layers["model.layers.3.mlp.down_proj"]["sqnr_db"] = 12.0      # 9 dB below its kind's median
    layers["model.layers.0.self_attn.q_proj"] = {"sqnr_db": 5.0}  # alone in its kind: nothing to compare with
    assert flag_outliers(layers) == ["model.layers.3.mlp.down_proj"]

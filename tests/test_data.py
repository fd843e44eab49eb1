"""quantkit.calibration.data: local files, hub names (mocked), calibration windows, eval stream, error messages."""

import json
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit.calibration import data
from quantkit.core.errors import QuantkitError
from quantkit.eval import eval_ids

TOKENIZER_DIR = Path(quantkit.__file__).parent / "assets" / "stories260k"

DOCS = [f"Once upon a time there was a little cat number {i}. It liked to play in the sun." for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture
def txt_file(tmp_path):
    path = tmp_path / "docs.txt"
    # blank and whitespace-only lines are not documents
    path.write_text("\n\n".join(DOCS[:20]) + "\n   \n" + "\n".join(DOCS[20:]) + "\n", encoding="utf-8")
    return path


def stream_of(tokenizer, texts):
    return tokenizer("\n\n".join(texts), return_tensors="pt")["input_ids"][0]


# --------------------------------------------------------------------------- local files


def test_txt_documents_are_non_empty_lines(txt_file):
    assert data.load_texts(str(txt_file), "calibration") == DOCS


def test_jsonl_records(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS)) + "\n\n", encoding="utf-8")
    assert data.load_texts(str(path), "eval") == DOCS


@pytest.mark.parametrize(
    "content",
    [
        [{"text": t} for t in DOCS],
        {"data": [{"text": t} for t in DOCS]},
        {"rows": [{"row_idx": i, "row": {"text": t}} for i, t in enumerate(DOCS)]},  # datasets-server shape
    ],
    ids=["list", "data", "rows"],
)
def test_json_shapes(tmp_path, content):
    path = tmp_path / "docs.json"
    path.write_text(json.dumps(content), encoding="utf-8")
    assert data.load_texts(str(path), "calibration") == DOCS


def test_parquet_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), path)
    assert data.load_texts(str(path), "calibration") == DOCS


def test_parquet_without_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": DOCS}), path)
    with pytest.raises(QuantkitError, match=r'no "text" column \(columns: content\)'):
        data.load_texts(str(path), "calibration")


def test_parquet_that_is_not_parquet(tmp_path):
    pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    path.write_text("not parquet at all")
    with pytest.raises(QuantkitError, match="is not a readable parquet file"):
        data.load_texts(str(path), "calibration")


# --------------------------------------------------------------------------- error paths


def test_unknown_name_lists_known_names_and_paths():
    with pytest.raises(QuantkitError) as err:
        data.load_texts("wikitext3", "eval")
    message = str(err.value)
    assert "unknown dataset 'wikitext3'" in message
    assert all(name in message for name in data.KNOWN_DATASETS)
    assert "local" in message and ".txt" in message
    assert "\n" not in message


def test_missing_file(tmp_path):
    with pytest.raises(QuantkitError, match="does not exist: check the path"):
        data.load_texts(str(tmp_path / "nope.txt"), "eval")


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(QuantkitError, match="is not a file"):
        data.load_texts(str(tmp_path), "eval")


def test_unsupported_extension(tmp_path):
    path = tmp_path / "docs.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(QuantkitError, match=r"unsupported dataset file type '.csv'.*\.jsonl"):
        data.load_texts(str(path), "eval")


@pytest.mark.parametrize("name,content", [("empty.txt", ""), ("blank.txt", "\n  \n\n"), ("empty.jsonl", "\n"), ("empty.json", "[]")])
def test_file_without_text(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(QuantkitError, match="contains no text|is empty: pass a file with text"):
        data.load_texts(str(path), "eval")


def test_record_without_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"content": "x", "id": 1}) + "\n")
    with pytest.raises(QuantkitError, match=r'line 2 has no "text" field \(found: content, id\)'):
        data.load_texts(str(path), "eval")


def test_bad_json(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(QuantkitError, match="line 2 is not valid JSON"):
        data.load_texts(str(jsonl), "eval")
    js = tmp_path / "docs.json"
    js.write_text('{"something": 1}')
    with pytest.raises(QuantkitError, match='list of records with a "text" field'):
        data.load_texts(str(js), "eval")


def test_bad_purpose_is_a_programming_error(txt_file):
    with pytest.raises(ValueError):
        data.load_texts(str(txt_file), "training")


# --------------------------------------------------------------------------- hub names (mocked)


class FakeHub:
    """Stands in for datasets.load_dataset: records calls, returns a real in-memory Dataset."""

    def __init__(self, texts):
        self.texts = texts
        self.calls = []

    def __call__(self, *args, **kwargs):
        import datasets

        self.calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"text": self.texts})


@pytest.fixture
def fake_hub(monkeypatch):
    datasets = pytest.importorskip("datasets")
    hub = FakeHub(DOCS)
    monkeypatch.setattr(datasets, "load_dataset", hub)
    return hub


C4 = "allenai/c4"
EXPECTED_HUB_CALLS = [
    ("wikitext2", "calibration", ("wikitext", "wikitext-2-raw-v1"), {"split": "train"}),
    ("wikitext2", "eval", ("wikitext", "wikitext-2-raw-v1"), {"split": "test"}),
    ("c4", "calibration", (C4,), {"split": "train", "data_files": {"train": "en/c4-train.00000-of-01024.json.gz"}}),
    ("c4", "eval", (C4,), {"split": "validation", "data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"}}),
    ("pileval", "calibration", ("mit-han-lab/pile-val-backup",), {"split": "validation"}),
    ("pileval", "eval", ("mit-han-lab/pile-val-backup",), {"split": "validation"}),
]


@pytest.mark.parametrize("name,purpose,args,kwargs", EXPECTED_HUB_CALLS)
def test_hub_names_call_load_dataset_with_the_right_arguments(fake_hub, name, purpose, args, kwargs):
    assert data.load_texts(name, purpose) == DOCS
    assert fake_hub.calls == [(args, kwargs)]


def test_hub_failure_is_wrapped(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub\n(LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(QuantkitError) as err:
        data.load_texts("c4", "calibration")
    message = str(err.value)
    assert message.startswith("could not load dataset c4 from the hub (ConnectionError: Couldn't reach")
    assert message.endswith("pass a local file with --dataset PATH")
    assert "\n" not in message
    assert isinstance(err.value.__cause__, ConnectionError)


def test_hub_calibration_reads_only_what_it_needs(monkeypatch, tokenizer):
    datasets = pytest.importorskip("datasets")
    many = [f"Document {i} says hello to the world." for i in range(20_000)]
    monkeypatch.setattr(datasets, "load_dataset", FakeHub(many))
    tokenized_chars = []

    def counting_tokenizer(text, **kwargs):
        tokenized_chars.append(len(text))
        return tokenizer(text, **kwargs)

    ids = data.calibration_ids(counting_tokenizer, "pileval", nsamples=4, seqlen=32, seed=0)
    assert ids.shape == (4, 32)
    total_chars = len("\n\n".join(many))
    assert max(tokenized_chars) < total_chars / 50  # a few thousand chars, not all 20k documents


# --------------------------------------------------------------------------- calibration windows


def test_calibration_windows_shape_and_dtype(tokenizer, txt_file):
    ids = data.calibration_ids(tokenizer, str(txt_file), nsamples=7, seqlen=24, seed=0)
    assert ids.shape == (7, 24)
    assert ids.dtype == torch.long


def test_calibration_is_deterministic_per_seed_and_varies_across_seeds(tokenizer, txt_file):
    before = torch.random.get_rng_state()
    first = data.calibration_ids(tokenizer, str(txt_file), nsamples=8, seqlen=16, seed=1)
    again = data.calibration_ids(tokenizer, str(txt_file), nsamples=8, seqlen=16, seed=1)
    other = data.calibration_ids(tokenizer, str(txt_file), nsamples=8, seqlen=16, seed=2)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert torch.equal(torch.random.get_rng_state(), before)  # global RNG untouched


def test_each_calibration_window_is_a_contiguous_slice_of_the_stream(tokenizer, txt_file):
    seqlen = 20
    stream = stream_of(tokenizer, DOCS)
    all_slices = stream.unfold(0, seqlen, 1)  # [T - seqlen + 1, seqlen]
    ids = data.calibration_ids(tokenizer, str(txt_file), nsamples=10, seqlen=seqlen, seed=3)
    for window in ids:
        assert (all_slices == window).all(dim=1).any()


def test_overlapping_windows_are_reported(tokenizer, txt_file, capsys):
    n_tokens = stream_of(tokenizer, DOCS).numel()
    data.calibration_ids(tokenizer, str(txt_file), nsamples=n_tokens // 16, seqlen=16, seed=0)
    assert capsys.readouterr().err == ""  # they fit side by side
    data.calibration_ids(tokenizer, str(txt_file), nsamples=n_tokens // 16 + 1, seqlen=16, seed=0)
    warning = capsys.readouterr().err
    assert warning.startswith("warning: ") and f"has {n_tokens} tokens" in warning and "overlap" in warning


def test_calibration_window_as_long_as_the_whole_stream(tokenizer, txt_file):
    stream = stream_of(tokenizer, DOCS)
    ids = data.calibration_ids(tokenizer, str(txt_file), nsamples=3, seqlen=stream.numel(), seed=0)
    assert torch.equal(ids, stream.expand(3, -1))


def test_calibration_text_shorter_than_a_window(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("Once upon a time.\n")
    n_tokens = stream_of(tokenizer, ["Once upon a time."]).numel()
    with pytest.raises(QuantkitError) as err:
        data.calibration_ids(tokenizer, str(path), nsamples=4, seqlen=64, seed=0)
    assert str(err.value) == (
        f"dataset {path} has only {n_tokens} tokens, fewer than --seqlen 64: use a longer file or a smaller --seqlen"
    )


@pytest.mark.parametrize("nsamples,seqlen", [(0, 16), (4, 0)])
def test_calibration_rejects_non_positive_sizes(tokenizer, txt_file, nsamples, seqlen):
    with pytest.raises(QuantkitError, match="must be at least 1"):
        data.calibration_ids(tokenizer, str(txt_file), nsamples=nsamples, seqlen=seqlen, seed=0)


# --------------------------------------------------------------------------- eval stream


def test_eval_ids_is_the_joined_stream(tokenizer, txt_file):
    ids = eval_ids(tokenizer, str(txt_file))
    expected = stream_of(tokenizer, DOCS)
    assert ids.shape == (1, expected.numel())
    assert torch.equal(ids[0], expected)
    assert ids[0, 0] == tokenizer.bos_token_id and (ids[0, 1:] != tokenizer.bos_token_id).all()


def test_eval_ids_max_tokens_is_a_prefix_of_the_full_stream(tokenizer, txt_file):
    full = eval_ids(tokenizer, str(txt_file))
    cut = eval_ids(tokenizer, str(txt_file), max_tokens=50)
    assert cut.shape == (1, 50)
    assert torch.equal(cut, full[:, :50])
    longer_than_text = eval_ids(tokenizer, str(txt_file), max_tokens=10**6)
    assert torch.equal(longer_than_text, full)


def test_long_stream_does_not_warn_about_model_max_length(tokenizer, txt_file, caplog):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()  # transformers' loggers do not reach caplog otherwise
    saved = tokenizer.model_max_length
    tokenizer.model_max_length = 16
    try:
        with caplog.at_level("WARNING"):
            eval_ids(tokenizer, str(txt_file))
            data.calibration_ids(tokenizer, str(txt_file), nsamples=2, seqlen=32, seed=0)
    finally:
        tokenizer.model_max_length = saved
        hf_logging.disable_propagation()
    assert "longer than the specified maximum" not in caplog.text


"""Calibration and evaluation text: where it comes from and how it becomes token ids.

A dataset is either a known hub name (``KNOWN_DATASETS``) or a path to a local file:

- ``.txt``: every non-empty line is one document (the line break itself is dropped);
- ``.jsonl``: one JSON record per line, each with a ``"text"`` field;
- ``.json``: a list of such records, or an object holding that list under ``"data"`` or ``"rows"``
  (records of the datasets-server shape ``{"row": {"text": ...}}`` are unwrapped);
- ``.parquet``: a ``"text"`` column.

Token protocol (the one the GPTQ / AWQ reference scripts use):

- documents are joined with ``"\\n\\n"`` into one stream and tokenized once with the tokenizer's
  defaults, so special tokens (BOS) appear only at the very start of the stream;
- calibration = ``nsamples`` windows of exactly ``seqlen`` tokens at seeded random offsets;
- evaluation = the whole stream as ``[1, T]``, optionally cut to its first ``max_tokens`` tokens
  (``quantkit.eval.eval_ids``, from ``token_stream`` here).

Hub datasets are large (a C4 shard holds ~356k documents), so only as many documents as the
request needs are read and tokenized (see ``_bounded_token_stream``).
"""

from __future__ import annotations

import codecs
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.core.errors import QuantkitError
from quantkit.core.textfile import check_path_name

KNOWN_DATASETS = ("wikitext2", "c4", "pileval")
PURPOSES = ("calibration", "eval")
LOCAL_EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet")

DOCUMENT_SEPARATOR = "\n\n"

# Used only to decide how much text to read before tokenizing. English BPE averages ~4 chars per
# token; when a tokenizer packs more, the stream is topped up (see _bounded_token_stream).
_CHARS_PER_TOKEN = 4
# Extra tokens to read past a cut of the stream (quantkit.eval.eval_ids) so the cut never lands on the last
# document, whose final tokens could merge differently with a following separator than with the end of the text.
CUT_MARGIN = 64


# --------------------------------------------------------------------------- hub sources


@dataclass(frozen=True)
class HubSource:
    """The exact `datasets.load_dataset` call for one known dataset and purpose."""

    path: str
    name: str | None = None
    split: str = "train"
    data_files: dict[str, str] | None = None

    def load_kwargs(self) -> dict:
        kwargs = {"split": self.split}
        if self.data_files is not None:
            kwargs["data_files"] = dict(self.data_files)
        return kwargs

    def load_args(self) -> tuple:
        return (self.path,) if self.name is None else (self.path, self.name)


_WIKITEXT = ("wikitext", "wikitext-2-raw-v1")
_C4_TRAIN = {"train": "en/c4-train.00000-of-01024.json.gz"}
_C4_VALIDATION = {"validation": "en/c4-validation.00000-of-00008.json.gz"}

HUB_SOURCES: dict[str, dict[str, HubSource]] = {
    "wikitext2": {
        "calibration": HubSource(*_WIKITEXT, split="train"),
        "eval": HubSource(*_WIKITEXT, split="test"),
    },
    "c4": {
        "calibration": HubSource("allenai/c4", split="train", data_files=_C4_TRAIN),
        "eval": HubSource("allenai/c4", split="validation", data_files=_C4_VALIDATION),
    },
    # pile-val-backup only has a validation split; AWQ calibrates on it.
    "pileval": {
        "calibration": HubSource("mit-han-lab/pile-val-backup", split="validation"),
        "eval": HubSource("mit-han-lab/pile-val-backup", split="validation"),
    },
}


def _iter_hub_texts(dataset: str, purpose: str) -> Iterator[str]:
    source = HUB_SOURCES[dataset][purpose]
    try:
        from datasets import load_dataset  # lazy: importing datasets costs ~1 s

        rows = load_dataset(*source.load_args(), **source.load_kwargs())
    except Exception as err:  # network, auth, missing file on the hub, datasets not installed …
        reason = _one_line(f"{type(err).__name__}: {err}")
        raise QuantkitError(
            f"could not load dataset {dataset} from the hub ({reason}): "
            "pass a local file with --dataset PATH"
        ) from err
    # Row order on the hub is fixed, so taking the first documents is reproducible. Empty rows
    # are kept: published WikiText-2 perplexities join every row, empty ones included.
    for index, row in enumerate(rows):
        yield _text_field(row, where=f"dataset {dataset} row {index}")


# --------------------------------------------------------------------------- local files


def _iter_local_texts(path: Path) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        texts = _read_txt(path)
    elif suffix == ".jsonl":
        texts = _read_jsonl(path)
    elif suffix == ".json":
        texts = _read_json(path)
    elif suffix == ".parquet":
        texts = _read_parquet(path)
    else:
        raise QuantkitError(
            f"unsupported dataset file type {path.suffix or '(no extension)'!r} for {path}: "
            f"use one of {', '.join(LOCAL_EXTENSIONS)}"
        )
    if not any(text.strip() for text in texts):
        raise QuantkitError(f"dataset file {path} contains no text: pass a file with some documents")
    return iter(texts)


def _read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise QuantkitError(f"dataset file {path} is not UTF-8 text ({err.reason}): re-save it as UTF-8") from err


def _read_txt(path: Path) -> list[str]:
    return [line for line in _read_text_file(path).splitlines() if line.strip()]


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    for number, line in enumerate(_read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise QuantkitError(f"{where} is not valid JSON ({err.msg}): write one JSON object per line") from err
        texts.append(_text_field(record, where=where))
    return texts


def _read_json(path: Path) -> list[str]:
    try:
        content = json.loads(_read_text_file(path))
    except json.JSONDecodeError as err:
        raise QuantkitError(f"dataset file {path} is not valid JSON ({err.msg} at line {err.lineno}): fix the file") from err
    records = _json_records(content, path)
    return [_text_field(record, where=f"{path} record {index}") for index, record in enumerate(records)]


def _json_records(content, path: Path) -> list:
    if isinstance(content, list):
        return content
    if isinstance(content, dict):
        for key in ("data", "rows"):
            if isinstance(content.get(key), list):
                return content[key]
    raise QuantkitError(
        f"dataset file {path} must hold a list of records with a \"text\" field "
        "(or an object with that list under \"data\" or \"rows\")"
    )


def _read_parquet(path: Path) -> list[str]:
    try:
        import pyarrow.parquet as pq  # a dependency of `datasets`, so normally present
    except ImportError as err:
        raise QuantkitError(f"reading {path} needs pyarrow: pip install pyarrow, or convert it to .jsonl") from err
    try:
        columns = pq.read_schema(path).names
    except Exception as err:  # pyarrow raises ArrowInvalid & co. for files that are not parquet
        raise QuantkitError(
            f"dataset file {path} is not a readable parquet file ({_one_line(str(err))}): check it or convert it to .jsonl"
        ) from err
    if "text" not in columns:
        raise QuantkitError(
            f"dataset file {path} has no \"text\" column (columns: {', '.join(columns) or 'none'}): "
            "rename the column holding the documents to \"text\""
        )
    column = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return [_text_field({"text": text}, where=f"{path} row {index}") for index, text in enumerate(column)]


def _text_field(record, where: str) -> str:
    """The "text" of one record; datasets-server rows wrap the record as {"row": {...}}."""
    if isinstance(record, dict) and "text" not in record and isinstance(record.get("row"), dict):
        record = record["row"]
    if not isinstance(record, dict) or "text" not in record:
        found = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise QuantkitError(f"{where} has no \"text\" field (found: {found or 'nothing'}): give every record a \"text\" string")
    text = record["text"]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise QuantkitError(f"{where} has a \"text\" field of type {type(text).__name__}: it must be a string")
    return text


# --------------------------------------------------------------------------- dataset resolution


def _iter_texts(dataset: str, purpose: str) -> Iterator[str]:
    """Documents of `dataset` for `purpose`, lazily where the source allows it."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    path = check_dataset(dataset)
    return _iter_hub_texts(dataset, purpose) if path is None else _iter_local_texts(path)


def check_dataset(dataset: str) -> Path | None:
    """The local file `dataset` names (None for a hub dataset name), or a QuantkitError for an unknown name or a path
    that is not a file. Reads nothing: commands call it before any weights load, so a typo is named at once."""
    if dataset in KNOWN_DATASETS:
        return None
    check_path_name(dataset, "--dataset")
    path = Path(dataset).expanduser()
    if path.is_file():
        _check_start(path)
        return path
    if path.exists():
        raise QuantkitError(f"dataset path {path} is not a file: pass a {'/'.join(LOCAL_EXTENSIONS)} file")
    if _looks_like_path(dataset):
        raise QuantkitError(f"dataset file {path} does not exist: check the path passed to --dataset")
    raise QuantkitError(
        f"unknown dataset {dataset!r}: use one of {', '.join(KNOWN_DATASETS)} "
        f"or a path to a local {'/'.join(LOCAL_EXTENSIONS)} file"
    )


def _check_start(path: Path) -> None:
    """An empty file, or a text file whose first MiB is binary or not UTF-8, refused at once (not after the model
    loaded and the text was read)."""
    size = path.stat().st_size
    if size == 0:
        raise QuantkitError(f"dataset file {path} is empty: pass a file with text in it")
    if path.suffix == ".parquet":
        return
    try:
        with open(path, "rb") as f:
            head = f.read(2**20)
    except OSError as e:
        raise QuantkitError(f"dataset file {path} cannot be read ({e.strerror}): check its permissions") from None
    if b"\x00" in head:
        raise QuantkitError(f"dataset file {path} is binary, not text: pass a UTF-8 {'/'.join(LOCAL_EXTENSIONS)} file")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) == size)
    except UnicodeDecodeError as e:
        raise QuantkitError(f"dataset file {path} is not UTF-8 text ({e.reason} at byte {e.start}): save it as "
                            "UTF-8") from None


def _looks_like_path(dataset: str) -> bool:
    return any(sep in dataset for sep in ("/", "\\")) or dataset.startswith(("~", ".")) or Path(dataset).suffix != ""


def load_texts(dataset: str, purpose: str) -> list[str]:
    """All documents of `dataset` (a name in KNOWN_DATASETS or a local file path) for `purpose`.

    purpose is "calibration" or "eval"; it picks the split of hub datasets (wikitext2: train/test,
    c4: the first train/validation shard, pileval: validation for both). Local files ignore it.
    Raises QuantkitError for an unknown name, a missing or unsupported file, a file without text,
    or a hub download that fails.
    """
    return list(_iter_texts(dataset, purpose))


# --------------------------------------------------------------------------- tokenization


def _tokenize_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Join documents with "\\n\\n" and tokenize once: a 1-D LongTensor of the whole stream."""
    # verbose=False silences only the "sequence length is longer than the specified maximum"
    # warning: the stream is meant to be longer than the context and is cut into windows.
    encoded = tokenizer(DOCUMENT_SEPARATOR.join(texts), return_tensors="pt", verbose=False)
    return encoded["input_ids"][0].to(torch.long)


def _bounded_token_stream(tokenizer, texts: Iterator[str], min_tokens: int) -> torch.Tensor:
    """Tokenize just enough leading documents to get at least `min_tokens` tokens (or all of them).

    Text is gathered by a character budget (~_CHARS_PER_TOKEN chars per token); if the tokenizer
    packs more characters per token than that, the budget doubles and the stream is re-tokenized.
    """
    documents: list[str] = []
    char_budget = min_tokens * _CHARS_PER_TOKEN
    while True:
        exhausted = _take_documents(texts, documents, char_budget)
        stream = _tokenize_stream(tokenizer, documents)
        if stream.numel() >= min_tokens or exhausted:
            return stream
        char_budget *= 2


def _take_documents(texts: Iterator[str], documents: list[str], char_budget: int) -> bool:
    """Append documents until their total length reaches `char_budget`; True if `texts` ran out."""
    chars = sum(len(doc) + len(DOCUMENT_SEPARATOR) for doc in documents)
    for text in texts:
        documents.append(text)
        chars += len(text) + len(DOCUMENT_SEPARATOR)
        if chars >= char_budget:
            return False
    return True


def token_stream(tokenizer, dataset: str, purpose: str, min_tokens: int | None = None) -> torch.Tensor:
    """The documents of `dataset` for `purpose` joined with "\\n\\n" and tokenized once, a 1-D LongTensor: the whole
    stream, or with `min_tokens` only as many leading documents as give at least that many tokens (all when fewer).
    A cut of it to n tokens equals the whole stream's first n when min_tokens >= n + CUT_MARGIN."""
    texts = _iter_texts(dataset, purpose)
    if min_tokens is None:
        return _tokenize_stream(tokenizer, list(texts))
    return _bounded_token_stream(tokenizer, texts, min_tokens)


def check_positive(value: int, option: str) -> None:
    """A QuantkitError naming `option` (--nsamples, ...) unless `value` is at least 1."""
    if int(value) < 1:
        raise QuantkitError(f"{option} must be at least 1, got {value}")


def calibration_ids(tokenizer, dataset: str, nsamples: int, seqlen: int, seed: int) -> torch.LongTensor:
    """`nsamples` calibration windows of exactly `seqlen` tokens: LongTensor [nsamples, seqlen].

    Protocol (GPTQ): the leading documents of the calibration split, joined with "\\n\\n", are
    tokenized once into a stream of T tokens; each window starts at an offset drawn uniformly from
    [0, T - seqlen] by a generator seeded with `seed` (global RNG state is neither used nor touched),
    so the same arguments always give the same windows. Windows may overlap when the text is short.
    Only about 2 * nsamples * seqlen tokens' worth of documents is read, so big hub datasets stay cheap.
    """
    check_positive(nsamples, "--nsamples")
    check_positive(seqlen, "--seqlen")
    min_tokens = 2 * nsamples * seqlen + seqlen  # room for mostly distinct windows
    stream = token_stream(tokenizer, dataset, "calibration", min_tokens)
    if stream.numel() < seqlen:
        raise QuantkitError(
            f"dataset {dataset} has only {stream.numel()} tokens, fewer than --seqlen {seqlen}: "
            "use a longer file or a smaller --seqlen"
        )
    if stream.numel() < nsamples * seqlen:
        print(f"warning: dataset {dataset} has {stream.numel()} tokens, fewer than the {nsamples} x {seqlen} the "
              "calibration windows cover: they overlap, so the statistics weigh repeated text; a longer text (or "
              "fewer --nsamples) gives distinct windows", file=sys.stderr)
    starts = _window_starts(stream.numel() - seqlen + 1, nsamples, seed)
    return stream[starts[:, None] + torch.arange(seqlen)]


def _window_starts(n_offsets: int, nsamples: int, seed: int) -> torch.Tensor:
    # random.Random (not torch.Generator) so the offsets are the same on every torch version/device.
    rng = random.Random(seed)
    return torch.tensor([rng.randrange(n_offsets) for _ in range(nsamples)], dtype=torch.long)


def _one_line(message: str, limit: int = 200) -> str:
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


__all__ = ["KNOWN_DATASETS", "HUB_SOURCES", "HubSource", "check_dataset", "load_texts", "token_stream",
           "calibration_ids"]

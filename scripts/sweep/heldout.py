"""The token ids the fp model and each quantized model are compared on: held-out real text, WINDOWS windows of
WINDOW tokens of WikiText-2's test split (the calibration reads the validation split), tokenized as quantkit
tokenizes a local text file (quantkit.eval.eval_ids) with the model folder's own tokenizer.

Fixed arithmetic ids would be an off-distribution input, on which GPTQ (fitted to its calibration text) loses to
RTN for no reason a user would meet; on held-out text of the calibration's kind the comparison says how well each
method keeps the model."""
import re
from pathlib import Path

from sweep.shrink import BOS, EOS, PAD, VOCAB

HELD_OUT = Path(__file__).resolve().parents[3] / "shared" / "assets" / "text" / "wikitext2_raw_test.txt"
WINDOWS, WINDOW = 2, 64


def held_out_ids(folder, config, text: Path, from_end: bool = False):
    """LongTensor [WINDOWS, WINDOW]: the first WINDOWS x WINDOW tokens of `text` tokenized with the tokenizer saved
    in `folder` (from_end: its last ones, where `text` is the calibration file itself and its start is what the
    calibration reads), with the ids that config gives a special meaning replaced (usable_text_ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    need = WINDOWS * WINDOW
    stream = _tail_stream(tokenizer, text, need) if from_end else _head_stream(tokenizer, text, need)
    if stream.numel() < need:
        raise ValueError(f"{text} holds {stream.numel()} tokens, fewer than the {need} the comparison reads")
    return usable_text_ids(stream[:need].view(WINDOWS, WINDOW), config)


def _head_stream(tokenizer, text: Path, tokens: int):
    from quantkit.eval import eval_ids

    return eval_ids(tokenizer, str(text), max_tokens=tokens)[0]


def _tail_stream(tokenizer, text: Path, tokens: int):
    """The last `tokens` tokens of the file's last documents, joined and tokenized as eval_ids joins them."""
    from quantkit.calibration.data import DOCUMENT_SEPARATOR, load_texts

    documents, chars = [], 0
    for document in reversed(load_texts(str(text), "eval")):
        documents.insert(0, document)
        chars += len(document)
        if chars >= 8 * tokens:  # a margin over any tokenizer's characters per token
            break
    return tokenizer(DOCUMENT_SEPARATOR.join(documents), return_tensors="pt")["input_ids"][0][-tokens:]


def usable_text_ids(ids, config):
    """ids with every id the model does not read as plain text mapped onto one it does: an id equal to one of the
    config's special tokens (image, audio, ... tokens: sweep.shrink moved those past the small vocabulary to its
    top ids, which this tokenizer's text uses; at such an id a model looks for pixel values) or past the text
    vocabulary. The mapping is fixed, so the fp and the quantized models see the same ids."""
    import torch

    text = config.get_text_config(decoder=True)
    vocab = text.vocab_size if isinstance(getattr(text, "vocab_size", None), int) else VOCAB
    special = sorted(special_token_ids(config.to_dict()) - {PAD, BOS, EOS})
    allowed = torch.tensor([i for i in range(EOS + 1, vocab) if i not in special])
    refused = (ids >= vocab) | torch.isin(ids, torch.tensor(special, dtype=ids.dtype))
    return torch.where(refused, allowed[ids % len(allowed)], ids)


def special_token_ids(d: dict) -> set:
    """Every value of a *token_id(s) / *token_index field of a config dict and of its sub-configs."""
    found = set()
    for key, value in d.items():
        if isinstance(value, dict):
            found |= special_token_ids(value)
        elif re.search(r"token_(id|ids|index)$", str(key)):
            values = value if isinstance(value, list) else [value]
            found |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
    return found

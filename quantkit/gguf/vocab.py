"""A transformers tokenizer as GGUF metadata (tokenizer.ggml.*), the two ways llama.cpp's converter writes one.

- byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen2): model "gpt2", the tokens by id, their types, the merges, and
  "pre", llama.cpp's name for the pre-tokenizer's split rules. Like llama.cpp's converter, the pre-tokenizer is
  recognised by the hash of the token ids the tokenizer gives a fixed check text (PRE_TOKENIZERS; the text and the
  hashes are llama.cpp's, so a file says what llama.cpp's own conversion says).
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral v0.1, TinyStories): model "llama", every score
  -1000 as llama.cpp's converter writes them from tokenizer.json, byte tokens <0xXX> typed BYTE.
Both add the special token ids, whether the tokenizer adds BOS / EOS (what its encode does), and the chat template.
"""
import hashlib
import json
import re
import tempfile
from pathlib import Path

from quantkit.core.errors import QuantkitError
from quantkit.gguf.file import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CHECK_TEXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
              '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
              '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
              '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
PRE_TOKENIZERS = {  # sha256 of str(tokenizer.encode(CHECK_TEXT)) -> llama.cpp's pre-tokenizer name
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
}


def tokenizer_json(tokenizer) -> dict:
    """The tokenizer as tokenizer.json holds it (saved to a scratch folder: the one form every fast tokenizer has)."""
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save_pretrained(scratch)
        path = Path(scratch) / "tokenizer.json"
        if not path.is_file():
            raise QuantkitError("--checkpoint-format gguf needs a fast tokenizer (tokenizer.json) beside the model")
        return json.loads(path.read_text(encoding="utf-8"))


def vocab_metadata(tokenizer, vocab_size: int) -> list:
    """[(key, value type, value)] of tokenizer.ggml.* for a GGUF file."""
    spec = tokenizer_json(tokenizer)
    model = spec["model"]
    if model.get("type") != "BPE":
        raise QuantkitError(f"--checkpoint-format gguf writes BPE tokenizers; this model's is {model.get('type')!r}")
    vocab = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= vocab_size:
        raise QuantkitError(f"the tokenizer has token ids up to {max(vocab.values())} but the model's vocabulary has "
                            f"{vocab_size} rows: the tokenizer does not belong to this model")
    by_id = {i: t for t, i in vocab.items()}
    specials = set(tokenizer.all_special_ids)
    added = {a.content: a for a in tokenizer.added_tokens_decoder.values()}
    if model.get("byte_fallback"):
        meta = _sentencepiece_tokens(by_id, specials, vocab_size)
    else:
        meta = _byte_level_tokens(tokenizer, by_id, specials, added, vocab_size)
        meta.append(("tokenizer.ggml.merges", ARRAY, (STRING, [m if isinstance(m, str) else " ".join(m)
                                                               for m in model.get("merges", [])])))
    return meta + _special_metadata(tokenizer)


def _byte_level_tokens(tokenizer, by_id, specials, added, vocab_size) -> list:
    digest = hashlib.sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest not in PRE_TOKENIZERS:
        raise QuantkitError(f"this tokenizer's pre-tokenizer (check hash {digest[:16]}...) is not one llama.cpp's "
                            f"converter names ({', '.join(sorted(set(PRE_TOKENIZERS.values())))}): llama.cpp would "
                            "split its text differently; write the model in another format")
    tokens, types = [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif text in added:
            tokens.append(text)
            types.append(CONTROL if added[text].special or i in specials else USER_DEFINED)
        else:
            tokens.append(text)
            types.append(NORMAL)
    return [("tokenizer.ggml.model", STRING, "gpt2"), ("tokenizer.ggml.pre", STRING, PRE_TOKENIZERS[digest]),
            ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)), ("tokenizer.ggml.token_type", ARRAY, (INT32, types))]


def _sentencepiece_tokens(by_id, specials, vocab_size) -> list:
    tokens, types = [], []
    for i in range(vocab_size):
        text = by_id.get(i, f"[PAD{i}]")
        tokens.append(text)
        types.append(UNUSED if i not in by_id else BYTE if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text)
                     else CONTROL if i in specials else NORMAL)
    return [("tokenizer.ggml.model", STRING, "llama"), ("tokenizer.ggml.pre", STRING, "default"),
            ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
            ("tokenizer.ggml.scores", ARRAY, (FLOAT32, [-1000.0] * vocab_size)),
            ("tokenizer.ggml.token_type", ARRAY, (INT32, types))]


def _special_metadata(tokenizer) -> list:
    meta = []
    for kind, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):  # llama.cpp's keys
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is not None:
            meta.append((f"tokenizer.ggml.{key}_token_id", UINT32, int(token_id)))
    ids = tokenizer.encode("a")  # what the tokenizer adds around a text, as llama.cpp must
    for kind, position in (("bos", 0), ("eos", -1)):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        meta.append((f"tokenizer.ggml.add_{kind}_token", BOOL, token_id is not None and ids[position] == token_id))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        meta.append(("tokenizer.chat_template", STRING, template))
    return meta

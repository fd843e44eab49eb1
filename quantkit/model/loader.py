"""Loading the floating-point source model and tokenizer from a hub id or a local folder."""
import os
from pathlib import Path

import torch

from quantkit.errors import QuantkitError

DTYPES = {"auto": "auto", "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name):
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise QuantkitError(f"unknown dtype '{name}': use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def looks_local(source: str) -> bool:
    """A path-like MODEL argument is never sent to the hub (no surprise downloads)."""
    return os.path.exists(source) or source.startswith((".", "/", "~")) or source.count("/") > 1


def stored_dtype(model) -> torch.dtype:
    """The dtype the source checkpoint declares (what dtype="auto" gives), fp32 when unknown."""
    from transformers import AutoConfig

    declared = getattr(AutoConfig.from_pretrained(model.name_or_path), "dtype", None)
    return declared if isinstance(declared, torch.dtype) else torch.float32


def load_fp_model(source: str, dtype="auto"):
    """(model, tokenizer) in eval mode on CPU. Errors name the problem and the fix."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(source)
    if looks_local(source):
        path = Path(source).expanduser()
        if not path.is_dir():
            raise QuantkitError(f"model path {source} not found: pass an existing model folder or a hub id like org/name")
        if not (path / "config.json").is_file():
            raise QuantkitError(f"{source} has no config.json: pass a Hugging Face model folder (save_pretrained output)")
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=parse_dtype(dtype))
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QuantkitError(f"could not load model '{source}' ({first}): check the id or path, "
                            "or download the model and pass its folder") from e
    model.eval()
    return model, tokenizer

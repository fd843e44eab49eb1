"""llama.cpp's file types (Q4_K_M, Q3_K_M, ...): which block type each layer gets, as llama-quantize chooses it.

A file type is a default block type plus a few rules that give some tensors more bits (src/llama-quant.cpp,
llama_tensor_get_type, for dense models: no experts, not Falcon), then the fallback for rows that are not whole
blocks (tensor_type_fallback); a calibrated method (gptq, awq) follows the rules llama.cpp takes with an imatrix.
quantkit gives every layer the type llama.cpp would, so a quantkit file and llama.cpp's of the same file type are
the same size. The token embeddings and the output stay as the checkpoint
keeps them (in float unless --lm-head; a quantized lm_head gets llama.cpp's output type).
"""
import re
from collections import Counter

from quantkit.core.errors import QuantkitError
from quantkit.gguf.arch import gguf_name
from quantkit.gguf.kquants import SUPER
from quantkit.gguf.types import TYPES

DEFAULT = {"Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K",
           "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0",
           "Q5_1": "Q5_1", "Q8_0": "Q8_0", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "IQ2_XXS": "IQ2_XXS",
           "IQ3_XXS": "IQ3_XXS"}
FILE_TYPES = tuple(DEFAULT)
# A type whose blocks do not fit a row falls back to one of blocks of 32 (tensor_type_fallback)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
            **dict.fromkeys(("IQ4_XS", "IQ2_XXS", "IQ3_XXS", "IQ2_S", "IQ3_S"), "IQ4_NL")}


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _rule(file_type: str, role: str, i: int, n: int, gqa: float, calibrated: bool) -> str | None:
    """The type a rule gives the i-th of n tensors of this role (attn_v, ffn_down, attn_output), or None."""
    if file_type in ("Q4_0", "Q5_0") and calibrated and role == "ffn_down" and i < n // 8:
        return file_type[:3] + "1"  # llama.cpp's guard of the first ffn_down layers, taken with an imatrix only
    if file_type == "Q2_K":
        return {"attn_v": "Q4_K" if gqa >= 4 else "Q3_K", "ffn_down": "Q3_K", "attn_output": "Q3_K"}.get(role)
    if file_type == "Q3_K_M":
        return {"attn_v": "Q5_K" if i < 2 else "Q4_K", "ffn_down": "Q5_K" if i < n // 16 else "Q4_K",
                "attn_output": "Q4_K"}.get(role)
    if file_type == "Q3_K_L":
        return "Q5_K" if role in ("attn_v", "ffn_down", "attn_output") else None
    if file_type == "Q4_K_S":
        return {"attn_v": "Q5_K" if i < 4 else None, "ffn_down": "Q5_K" if i < n // 8 else None}.get(role)
    if file_type in ("IQ4_NL", "IQ4_XS"):
        return {"attn_v": "Q5_K" if gqa >= 4 else None,
                "ffn_down": "Q5_K" if i < n // 8 and not calibrated else None}.get(role)
    if file_type == "IQ2_XXS":
        return {"attn_v": "Q4_K" if gqa >= 4 else "Q2_K", "ffn_down": "Q2_K" if i < n // 8 else None}.get(role)
    if file_type == "IQ3_XXS":
        return {"attn_v": "Q4_K" if gqa >= 4 else "IQ3_XXS" if calibrated else "IQ3_S", "attn_q": "IQ2_S",
                "attn_k": "IQ2_S", "attn_output": "IQ3_S",
                "ffn_down": None if calibrated else "Q4_K" if i < n // 8 else "Q3_K"}.get(role)
    if file_type in ("Q4_K_M", "Q5_K_M"):
        return "Q6_K" if role in ("attn_v", "ffn_down") and _more_bits(i, n) else None
    return None


def _output_type(file_type: str, cols: int) -> str:
    """A quantized output's type (--lm-head): Q8_0 for rows that are not whole super-blocks or in a Q8_0 file, Q5_K
    in the IQ2 / IQ3 files, else Q6_K."""
    if file_type == "Q8_0" or cols % TYPES["Q6_K"].block:
        return "Q8_0"
    return "Q5_K" if file_type in ("IQ2_XXS", "IQ3_XXS") else "Q6_K"


def check_file_type(file_type: str) -> None:
    if file_type not in DEFAULT:
        raise QuantkitError(f"unknown --gguf-type {file_type!r}: choose one of {', '.join(FILE_TYPES)}")


def layer_types(file_type: str, shapes: dict, model_config: dict, calibrated: bool = False) -> dict:
    """{layer: block type} for the layers in `shapes` ({name: (in_features, out_features)}). calibrated: the method
    weighs its rounding by calibration statistics (gptq, awq), as llama.cpp does with an imatrix, whose rules it
    then follows."""
    check_file_type(file_type)
    gqa = model_config.get("num_attention_heads", 1) / (model_config.get("num_key_value_heads")
                                                         or model_config.get("num_attention_heads", 1))
    roles = {name: _role(name) for name in shapes}
    counts = Counter(role for role, _ in roles.values())
    types = {}
    for name, (cols, _) in shapes.items():
        role, i = roles[name]
        if role == "output":
            types[name] = _output_type(file_type, cols)
            continue
        kind = _rule(file_type, role, i, counts[role], gqa, calibrated) or DEFAULT[file_type]
        if cols % SUPER:  # the fallbacks are for types of super-blocks
            kind = FALLBACK.get(kind, kind)
        if kind not in TYPES:
            raise QuantkitError(f"llama.cpp's {file_type} gives {name} type {kind}, which quantkit does not write yet: "
                                f"choose another --gguf-type, or keep {name} in float with a recipe skip")
        types[name] = kind
    return types


def _role(name: str) -> tuple[str, int]:
    """(role, layer index) from the tensor's GGUF name: blk.3.attn_v.weight -> ("attn_v", 3); output.weight ->
    ("output", 0)."""
    gguf = gguf_name(name + ".weight") or ""
    match = re.match(r"blk\.(\d+)\.(\w+)\.weight$", gguf)
    if match:
        return match.group(2), int(match.group(1))
    return ("output" if gguf == "output.weight" else gguf), 0

"""Every llama.cpp block type quantkit writes, in one table, and which quantizer settings make each.

    legacy blocks of 32 (quantkit.gguf.legacy_blocks):  Q4_0 Q4_1 Q5_0 Q5_1 Q8_0
        from --quantizer ggml (or a symmetric 4- / 8-bit integer grid: Q4_0 / Q8_0), --group-size 32
    k-quant super-blocks of 256 (quantkit.gguf.kquants_blocks):  Q2_K Q3_K Q4_K Q5_K Q6_K
        from --quantizer kquant, --group-size the type's sub-block (16 or 32)
    non-linear 4-bit (quantkit.gguf.iq4_blocks):  IQ4_NL (blocks of 32), IQ4_XS (super-blocks of 256)
        from --quantizer iq4nl / iq4xs, --bits 4 --group-size 32
    E8-lattice lists (quantkit.gguf.iq_lattice_blocks):  IQ2_XXS, IQ3_XXS (super-blocks of 256)
        from --quantizer iq2xxs / iq3xxs, --bits 2 / 3 --group-size 32

Parameters travel as the quantizer names them: {"d"} / {"d", "m"} per block of 32, {"d", "sc"} / {"d", "sc",
"dmin", "m"} per k-quant sub-block. The integer grid's {"scale", "zero"} become a Q4_0 / Q8_0 block's {"d"}.
"""
from dataclasses import dataclass

import torch

from quantkit.gguf import iq4_blocks, iq_lattice_blocks, kquants_blocks, legacy_blocks
from quantkit.gguf.iq4 import IQ4NL, IQ4XS
from quantkit.gguf.iq_lattice import IQ2XXS, IQ3XXS
from quantkit.gguf.kquants import KTYPES, SUPER
from quantkit.gguf.legacy import TYPES as LEGACY_SETTINGS

INT_TYPES = {4: "Q4_0", 8: "Q8_0"}  # the symmetric integer grid's widths a legacy block holds as they are


class _Legacy:
    """quantkit.gguf.legacy_blocks with the interface the other layouts have (the quantizer's params dict)."""

    @staticmethod
    def encode(name: str, codes: torch.Tensor, params: dict) -> torch.Tensor:
        return legacy_blocks.encode(legacy_blocks.TYPES[name], codes, params["d"], params.get("m"))

    @staticmethod
    def decode(name: str, data: torch.Tensor) -> tuple[torch.Tensor, dict]:
        codes, d, m = legacy_blocks.decode(legacy_blocks.TYPES[name], data)
        return codes, {"d": d.float(), **({"m": m.float()} if m is not None else {})}

    @staticmethod
    def dequantize(name: str, data: torch.Tensor) -> torch.Tensor:
        return legacy_blocks.dequantize(legacy_blocks.TYPES[name], data)


@dataclass(frozen=True)
class GGUFType:
    name: str
    ggml_type: int     # GGMLQuantizationType's value, as GGUF files store it
    block: int         # weights per block: a row's width must be a multiple
    block_bytes: int
    group_size: int    # the quantizer's group (a block of 32, or a sub-block)
    layout: object     # the module that lays the blocks out: encode / decode / dequantize (name, ...)

    def encode(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        """uint8 [rows, K / block * block_bytes] from codes [rows, K] and the quantizer's params [rows, groups]."""
        return self.layout.encode(self.name, codes, params)

    def decode(self, data: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(codes [rows, K] int32, params {key: float32 [rows, groups]}), exactly as encoded."""
        return self.layout.decode(self.name, data)

    def dequantize(self, data: torch.Tensor) -> torch.Tensor:
        """float32 [rows, K], as llama.cpp decodes."""
        return self.layout.dequantize(self.name, data)


TYPES = {**{t.name: GGUFType(t.name, t.ggml_type, legacy_blocks.BLOCK, t.block_bytes, legacy_blocks.BLOCK, _Legacy)
            for t in legacy_blocks.TYPES.values()},
         **{k.name: GGUFType(k.name, kquants_blocks.GGML_TYPES[k.name], SUPER, k.block_bytes, k.sub, kquants_blocks)
            for k in KTYPES.values()},
         "IQ4_NL": GGUFType("IQ4_NL", 20, 32, iq4_blocks.BYTES["IQ4_NL"], 32, iq4_blocks),
         "IQ4_XS": GGUFType("IQ4_XS", 23, SUPER, iq4_blocks.BYTES["IQ4_XS"], 32, iq4_blocks),
         "IQ2_XXS": GGUFType("IQ2_XXS", 16, SUPER, iq_lattice_blocks.BYTES["IQ2_XXS"], 32, iq_lattice_blocks),
         "IQ3_XXS": GGUFType("IQ3_XXS", 18, SUPER, iq_lattice_blocks.BYTES["IQ3_XXS"], 32, iq_lattice_blocks)}
BY_GGML_TYPE = {t.ggml_type: t for t in TYPES.values()}
NAMED = {q.name: q for q in (IQ4NL, IQ4XS, IQ2XXS, IQ3XXS)}  # the quantizers that make one type each, by name


def type_of_settings(quantizer: str, bits, sym) -> str | None:
    """The block type a layer's quantizer settings give (its groups the type's group size), or None."""
    if quantizer == "ggml" and (bits, sym) in LEGACY_SETTINGS:
        return LEGACY_SETTINGS[(bits, sym)]
    if quantizer == "kquant" and bits in KTYPES:
        return KTYPES[bits].name
    if quantizer in NAMED:
        return NAMED[quantizer].ggml_type
    return INT_TYPES.get(bits) if quantizer == "int" and sym else None


def settings_of_type(name: str) -> dict:
    """The quantizer settings that make block type `name`: {"quantizer", "bits", "sym", "group_size"}."""
    for q in NAMED.values():
        if q.ggml_type == name:
            return {"quantizer": q.name, "bits": q.type_bits, "sym": True, "group_size": q.type_group}
    if name in kquants_blocks.TYPES:
        bits = next(b for b, k in KTYPES.items() if k.name == name)
        return {"quantizer": "kquant", "bits": bits, "sym": not KTYPES[bits].has_min, "group_size": TYPES[name].group_size}
    bits, sym = next(key for key, t in LEGACY_SETTINGS.items() if t == name)
    return {"quantizer": "ggml", "bits": bits, "sym": sym, "group_size": legacy_blocks.BLOCK}


def quantizer_params(quantizer, params: dict) -> dict:
    """A layer's params as its block type takes them (the integer grid's scale is a legacy block's d)."""
    return {"d": params["scale"]} if quantizer.name == "int" else params


def params_of_type(quantizer, params: dict) -> dict:
    """The inverse of quantizer_params: decoded block params as the quantizer keeps them."""
    if quantizer.name != "int":
        return params
    return {"scale": params["d"], "zero": torch.full_like(params["d"], 2 ** (quantizer.bits - 1))}


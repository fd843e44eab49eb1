"""QuantConfig: every option of a quantization run, validated once; recipes load into it.

A recipe is a YAML or TOML file whose keys mirror the CLI options (dashes or underscores) plus a
`modules` list of per-module overrides, applied in order to each quantizable module's full name:

    method: gptq
    bits: 4
    group_size: 128
    modules:
      - pattern: 'model\\.layers\\.0\\.mlp\\.down_proj'   # regex, re.search on the full name
        bits: 8
      - pattern: 'self_attn\\.o_proj'
        skip: true                                       # leave this one in floating point

An override that matches one linear of a fused group (q/k/v, gate/up: quantkit.models.arch `fused`) applies to
the whole group, because vLLM runs the group as one layer with one setting; `split_fused: true` limits it to
the linears it matches (a checkpoint vLLM refuses; the compat report says so).
"""
import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from quantkit.algorithms.registry import method_spec
from quantkit.checkpoint import codecs, gguf_mix
from quantkit.core.errors import QuantkitError
from quantkit.core.textfile import read_user_text
from quantkit.schemes.base import quantizer_for, quantizer_names
from quantkit.schemes.grid import check_bits, check_group_size, is_int

ROTATIONS = ("none", "hadamard")
MOE_CALIBRATION = ("all", "routed")
OVERRIDE_TYPES = {"pattern": str, "bits": int, "group_size": int, "sym": bool, "skip": bool, "split_fused": bool}
COMPAT_TARGETS = ("none", "any", "vllm", "transformers", "gptqmodel")
_TYPE_WORDS = {bool: "true or false, without quotes", int: "a whole number, without quotes",
               float: "a number, without quotes", str: "a string (in quotes)", list: "a list of '- pattern: ...' items"}


def check_type(value, expected, key: str, where: str = "recipe"):
    """`value` as `expected` (an int is fine for a float), or a QuantkitError: a quoted 'false' is no boolean."""
    if expected is float and is_int(value):
        return float(value)
    if not (is_int(value) if expected is int else isinstance(value, expected)):
        raise QuantkitError(f"{where} {key} must be {_TYPE_WORDS[expected]}; got {value!r} ({type(value).__name__})")
    return value


MAX_SEED = 2**31 - 1  # seeds past it would give the same rotations as smaller ones (schemes/rotation.py)


@dataclass(frozen=True)
class LayerSpec:
    """How one module is quantized after overrides."""
    bits: int
    group_size: int
    sym: bool

    quantizer_name: str = "int"

    def quantizer(self):
        return quantizer_for(self.quantizer_name, self.bits, self.sym, self.group_size)


@dataclass
class QuantConfig:
    method: str = "rtn"
    quantizer: Optional[str] = None  # None: the method's (int; turboquant or e8 for those methods)
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    dataset: str = "wikitext2"
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True
    true_sequential: bool = True
    awq_grid: int = 20
    awq_clip: bool = True
    checkpoint_format: Optional[str] = None  # None: gguf with --gguf-type, else gptq
    gguf_type: Optional[str] = None  # a llama.cpp file type (Q4_K_M, ...): every layer's block type, llama.cpp's mix
    rotate: Optional[str] = None     # None: the method's (none; hadamard for the turboquant and e8 methods)
    max_shard_size: str = "4GB"
    compat: str = "none"             # reader(s) whose refusal is an error before any work; none: warnings only
    moe_calibration: str = "all"     # all: every expert's statistics from every token; routed: its routed ones
    lm_head: bool = False            # quantize the output projection too (untied from the embeddings)
    modules: list = field(default_factory=list)
    target_bits: Optional[float] = None  # bits per weight of the quantized linears, each one's setting measured
                                         # (quantkit.run.allocate); None: every layer the same settings

    def __post_init__(self):
        if isinstance(self.dataset, os.PathLike):
            self.dataset = str(self.dataset)
        spec = method_spec(self.method)  # an unknown method is refused with the choices
        if self.quantizer is None:  # what the method implies when --quantizer / --rotate are not given
            self.quantizer = spec.quantizer or "int"
        if self.rotate is None:
            self.rotate = spec.rotate
        if self.checkpoint_format is None:
            self.checkpoint_format = "gptq" if self.gguf_type is None else "gguf"
        for f in dataclasses.fields(self):
            if f.name in ("gguf_type", "target_bits") and getattr(self, f.name) is None:
                continue
            if f.name == "max_shard_size" and is_int(self.max_shard_size):
                continue  # a byte count is as good as "4GB"
            expected = {"modules": list, "quantizer": str, "rotate": str, "checkpoint_format": str,
                        "gguf_type": str, "target_bits": float}.get(f.name, f.type)
            setattr(self, f.name, check_type(getattr(self, f.name), expected, f.name, "option"))
        check_group_size(self.group_size)
        for name in ("nsamples", "seqlen", "block_size", "awq_grid"):
            if getattr(self, name) < 1:
                raise QuantkitError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if not 0 <= self.seed <= MAX_SEED:  # the rotations draw their signs from a 31-bit seed: larger ones alias
            raise QuantkitError(f"--seed {self.seed} is out of range: use an integer from 0 to {MAX_SEED}")
        if not 0 < self.damp <= 1:
            raise QuantkitError(f"--damp {self.damp} is out of range: use a fraction in (0, 1], e.g. 0.01")
        if self.quantizer not in quantizer_names():
            raise QuantkitError(f"unknown quantizer '{self.quantizer}': choose one of {', '.join(quantizer_names())}")
        implied = spec.quantizer
        if implied and self.quantizer != implied:
            raise QuantkitError(f"--method {self.method} rounds with the {implied} quantizer, not {self.quantizer}: "
                                f"drop --quantizer (or use --method {'gptq' if self.method.endswith('gptq') else 'rtn'} "
                                f"--quantizer {self.quantizer})")
        if self.rotate not in ROTATIONS:
            raise QuantkitError(f"unknown rotation '{self.rotate}': use {' or '.join(ROTATIONS)}")
        if self.rotate != "none" and "awq" in self.method:
            raise QuantkitError(f"--rotate {self.rotate} does not work with --method {self.method}: AWQ's "
                                "scales are searched in the unrotated basis")
        if self.moe_calibration not in MOE_CALIBRATION:
            raise QuantkitError(f"unknown --moe-calibration '{self.moe_calibration}': use {' or '.join(MOE_CALIBRATION)}")
        if self.compat not in COMPAT_TARGETS:
            raise QuantkitError(f"unknown --compat '{self.compat}': use one of {', '.join(COMPAT_TARGETS)}")
        codecs.codec_of_format(self.checkpoint_format)  # an unknown name is refused with the choices
        self._check_gguf_type()
        self.modules = [self._check_override(o, i) for i, o in enumerate(self.modules)]
        self._check_target_bits()
        self._check_quantizers()

    def _check_target_bits(self) -> None:
        if self.target_bits is None:
            return
        if not 0 < self.target_bits <= 16:
            raise QuantkitError(f"--target-bits {self.target_bits} is out of range: give the bits per weight of the "
                                "quantized linears, e.g. 3.5")
        if self.quantizer != "int" or self.gguf_type is not None or codecs.codec_of_format(self.checkpoint_format) \
                .layer_bits is None:
            raise QuantkitError("--target-bits chooses integer widths and group sizes for the gptq, gptq_v2 and "
                                "compressed-tensors formats: use it with --method rtn, gptq, awq or awq+gptq and one "
                                "of those --checkpoint-format values (codebook rates and GGUF types are not chosen yet)")
        if any(k in o for o in self.modules for k in ("bits", "group_size")):
            raise QuantkitError("--target-bits chooses every layer's bits and group size: drop the recipe's per-module "
                                "bits / group_size (skip: true still keeps a layer in float)")

    def _check_gguf_type(self) -> None:
        if self.gguf_type is None:
            return
        gguf_mix.check_file_type(self.gguf_type)
        if self.checkpoint_format != "gguf":
            raise QuantkitError(f"--gguf-type {self.gguf_type} makes a llama.cpp file: use it with --checkpoint-format "
                                f"gguf (or leave --checkpoint-format out), not {self.checkpoint_format}")
        if self.quantizer != "int" or any(k in o for o in self.modules for k in ("bits", "group_size", "sym")):
            raise QuantkitError(f"--gguf-type {self.gguf_type} sets every layer's block type (llama.cpp's mix), "
                                "rounded by rtn, gptq or awq: drop --quantizer (and --method "
                                f"{self.method} if it implies one) and the recipe's per-module bits / group_size / "
                                "sym (skip: true still keeps a layer in float)")

    def _check_quantizers(self) -> None:
        """Build the quantizer of the run's settings and of each override, so bad bits fail before any work."""
        base = {"bits": self.bits, "group_size": self.group_size, "sym": self.sym}
        for where, override in [("", {})] + [(f"recipe modules[{i}]", o) for i, o in enumerate(self.modules)]:
            settings = {**base, **{k: override[k] for k in base if k in override}}
            if self.quantizer == "int":
                check_bits(settings["bits"], f"{where} bits" if where else "--bits")
            try:
                LayerSpec(**settings, quantizer_name=self.quantizer).quantizer()
            except QuantkitError as e:
                raise QuantkitError(f"{where}: {e}" if where else str(e)) from e

    @staticmethod
    def _check_override(o, i) -> dict:
        where = f"recipe modules[{i}]"
        if not isinstance(o, dict) or "pattern" not in o:
            raise QuantkitError(f"{where} needs a 'pattern' (regex on module names) and settings such as bits: 8 or skip: true")
        unknown = set(o) - set(OVERRIDE_TYPES)
        if unknown:
            raise QuantkitError(f"{where} has unknown keys {sorted(unknown)}: allowed are {sorted(OVERRIDE_TYPES)}")
        for key, value in o.items():
            check_type(value, OVERRIDE_TYPES[key], key, where)
        try:
            re.compile(o["pattern"])
        except re.error as e:
            raise QuantkitError(f"{where} pattern {o['pattern']!r} is not a valid regex: {e}") from e
        if "group_size" in o:
            check_group_size(o["group_size"], f"{where} group_size")
        return dict(o)

    @property
    def needs_calibration(self) -> bool:
        return method_spec(self.method).needs_calibration

    @staticmethod
    def _matches(o: dict, name: str, siblings, aliases=()) -> bool:
        names = (name, *aliases) if o.get("split_fused") else (name, *aliases, *siblings)
        return any(re.search(o["pattern"], n) for n in names)

    def spec_for(self, name: str, siblings=(), aliases=()) -> Optional[LayerSpec]:
        """The settings for module `name`, or None when an override skips it. siblings: the other linears of its
        fused group (quantkit.models.arch.fused_siblings), which an override of any of them covers too; aliases:
        its other names (its name in the checkpoint's files, quantkit.models.names), which a pattern may match."""
        spec = {"bits": self.bits, "group_size": self.group_size, "sym": self.sym}
        for o in self.modules:
            if self._matches(o, name, siblings, aliases):
                if o.get("skip"):
                    return None
                spec.update({k: o[k] for k in ("bits", "group_size", "sym") if k in o})
        return LayerSpec(**spec, quantizer_name=self.quantizer)

    def unmatched_overrides(self, names, siblings=None, aliases=None) -> list[str]:
        """The recipe's overrides whose pattern matches none of `names` (a misspelled pattern changes nothing);
        siblings: {name: its fused group's other linears}; aliases: {name: its other names}."""
        siblings, aliases = siblings or {}, aliases or {}
        return [f"recipe modules[{i}] pattern {o['pattern']!r}" for i, o in enumerate(self.modules)
                if not any(self._matches(o, n, siblings.get(n, ()), aliases.get(n, ())) for n in names)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_recipe(path) -> dict:
    """Recipe file -> dict of QuantConfig fields (keys normalised to underscores)."""
    path = Path(path)
    text = read_user_text(path, "recipe file", "an existing .yaml/.yml/.toml file")
    try:
        if path.suffix == ".toml":
            raw = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            raw = yaml.safe_load(text) or {}
        else:
            raise QuantkitError(f"recipe {path} has an unknown extension: use .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise QuantkitError(f"recipe {path} is not valid {path.suffix[1:].upper()}: {e}") from e
    if not isinstance(raw, dict):
        raise QuantkitError(f"recipe {path} must be a mapping of option names to values")
    data = {k.replace("-", "_"): v for k, v in raw.items()}
    known = {f.name for f in dataclasses.fields(QuantConfig)}
    unknown = set(data) - known
    if unknown:
        raise QuantkitError(f"recipe {path} has unknown keys {sorted(unknown)}: allowed are {sorted(known)}")
    return data


def write_recipe(config: QuantConfig, path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))

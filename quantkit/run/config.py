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
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from quantkit.algorithms.registry import algorithm_options, method_help, method_names, method_spec
from quantkit.checkpoint import codecs
from quantkit.checkpoint.files import parse_size
from quantkit.core.errors import QuantkitError
from quantkit.core.options import Option, check_type, is_int
from quantkit.core.textfile import read_user_text
from quantkit.gguf import mix as gguf_mix
from quantkit.gguf import types as gguf_types
from quantkit.schemes.base import (is_method_quantizer, quantizer_for, quantizer_help, quantizer_names,
                                   serves_method)
from quantkit.schemes.grid import check_bits, check_group_size

ROTATIONS = ("none", "hadamard")
MOE_CALIBRATION = ("all", "routed")
OVERRIDE_TYPES = {"pattern": str, "bits": int, "group_size": int, "sym": bool, "skip": bool, "split_fused": bool,
                  "block_type": str}
COMPAT_TARGETS = ("none", "any", "vllm", "transformers", "gptqmodel")

def setting(default, help, choices=(), flag=None):
    """A field of the run's own settings with what the CLI needs to offer it: help (a str, or a callable when it
    names what registries hold), choices (a tuple or such a callable) and the flag when not --name."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


MAX_SEED = 2**31 - 1  # seeds past it would give the same rotations as smaller ones (schemes/rotation.py)


@dataclass(frozen=True)
class LayerSpec:
    """How one module is quantized after overrides."""
    bits: int
    group_size: int
    sym: bool

    quantizer_name: str = "int"
    block_type: Optional[str] = None  # a GGUF block type a recipe gives the layer (with --gguf-type), else None

    def quantizer(self):
        return quantizer_for(self.quantizer_name, self.bits, self.sym, self.group_size)


@dataclass(init=False)
class QuantConfig:
    """The run's own fields below, plus the options its algorithms declare (GPTQ's damp, AWQ's awq_grid, ...:
    quantkit.algorithms.registry), held in `options` and read as attributes (config.damp) like the fields.
    QuantConfig(**values) takes both by name; an unknown name is refused with the known ones."""
    method: str = setting("rtn", lambda: method_help() + ".", choices=method_names)
    quantizer: Optional[str] = setting(  # None: the method's (int; turboquant or e8 for those methods)
        None, lambda: "What rounds the weights. Default: the method's (int for rtn/gptq/awq; the method's own codebook "
                      "for the others). " + quantizer_help() + ". Anything but unrotated int is written in the "
                      "quantkit format.")
    bits: int = setting(4, "Bits per weight code; which widths a quantizer takes: see --quantizer.")
    group_size: int = setting(
        128, "Input columns sharing one scale (and zero); -1 = one group per row. A last shorter group is fine. "
             "turboquant: the block d, a power of two >= 8; e8: a multiple of 8 (both cost 16/group bits per weight "
             "for the scale).")
    target_bits: Optional[float] = setting(  # None: every layer the same settings
        None, "Choose each linear's bits and group size for this average bits per weight of the quantized linears "
              "(codes, scales, zeros and g_idx counted as the files store them), where its error costs least: each "
              "layer's cost is its Fisher-weighted rounding error, measured on 8 calibration windows (one backward "
              "each; with GPTQ, scaled by what its error feedback leaves); an exact knapsack picks from 2/3/4/8 bits x "
              "group sizes 32/64/128/-1, q/k/v and gate/up together, within --compat. Integer methods and the gptq, "
              "gptq_v2 and compressed-tensors formats; the codebook methods (turboquant, e8, trellis) choose from "
              "2/3/4 bits x the group sizes their quantizer takes; with --gguf-type auto, llama.cpp's block types per "
              "tensor. "
              "OUT's recipe holds the allocation (--recipe reproduces it). Replaces --bits and --group-size.")
    target_size: Optional[str] = setting(  # None: no size target
        None, "Like --target-bits, for the size of the checkpoint's safetensors files, or of model.gguf with "
              "--gguf-type auto (every tensor, embeddings and head included, and their headers): at most this many "
              "bytes, e.g. 80MB or 3.2GB (KB, MB, GB: powers "
              "of 1000; KiB, MiB, GiB: of 1024). The rest of the checkpoint is counted first; the quantized linears "
              "get what is left. Not with --target-bits.")
    sym: bool = setting(True, "Symmetric grid (zero fixed at 2^(bits-1)) or asymmetric min/max grid.",
                        flag="--sym/--asym")
    dataset: str = setting(
        "wikitext2", "Calibration data: wikitext2, c4, pileval (downloaded from the Hugging Face hub, cached), or a "
                     "local UTF-8 .txt/.jsonl/.json/.parquet file (offline). Unused by rtn.")
    nsamples: int = setting(128, "Calibration windows.")
    seqlen: int = setting(512, "Tokens per calibration window, at most the model's context (max_position_embeddings).")
    seed: int = setting(0, "Seed for choosing calibration windows (and rotation signs): an integer from 0 to "
                           "2147483647.")
    true_sequential: bool = setting(
        True, "Calibrate each stage of a block (q/k/v, o, gate/up, down) on the outputs of the already quantized "
              "stages before it (GPTQ rounding; with AWQ's round-to-nearest only the error report's inputs change). "
              "Also the faster way: the stages cost one block forward in all.")
    moe_calibration: str = setting(
        "all", "Mixture-of-experts models: all: while a block is calibrated every expert also computes every token, "
               "so each expert's statistics cover them all (the block's output keeps the true routing); routed: each "
               "expert's statistics from the tokens routed to it (an expert none reaches is rounded to nearest). The "
               "tokens routed to each expert are reported either way.", choices=MOE_CALIBRATION)
    lm_head: bool = setting(
        False, "Quantize lm_head too (after the last block, calibrated on the final norm's outputs; GPTQ methods "
               "round it with GPTQ, the others to nearest). A tied lm_head is untied: the embeddings stay in float. "
               "Saves vocab x hidden weights (SmolLM2: 57 MB of its 269 in bf16) and makes CPU decode read 4 bits "
               "per weight there; a recipe override (pattern: lm_head) sets its bits. vLLM and GPTQModel load it, "
               "transformers does not.")
    checkpoint_format: Optional[str] = setting(  # None: gguf with --gguf-type, else gptq
        None, lambda: codecs.format_help() + ". gptq and gptq_v2 write rotated and codebook layers in the quantkit "
                      "format. Default: gptq (gguf with --gguf-type).", choices=codecs.write_formats)
    gguf_type: Optional[str] = setting(  # a llama.cpp file type (Q4_K_M, ...): every layer's block type
        None, "Write a llama.cpp file of this file type: every layer gets the block type llama-quantize gives it for "
              "this type (Q4_K_M: Q4_K, with Q6_K on attn_v and ffn_down of half the layers; rows that are not whole "
              "super-blocks of 256 fall back as llama.cpp's do, e.g. Q4_K to Q5_0), rounded by --method (rtn, gptq, "
              "awq). Implies --checkpoint-format gguf; --bits, --group-size, --sym and --quantizer are not used. The "
              "embeddings and output stay in float (llama-quantize --token-embedding-type/--output-tensor-type f16 "
              "makes llama.cpp's file the same). auto: each tensor's block type chosen for --target-bits from its "
              "measured sensitivity (a recipe's block_type: per module sets one by hand).",
        choices=lambda: (*gguf_mix.FILE_TYPES, "auto"))
    rotate: Optional[str] = setting(  # None: the method's (none; hadamard for the turboquant and e8 methods)
        None, "hadamard: quantize each linear as W Πᵀ with a seeded randomized Hadamard rotation Π along its inputs "
              "(GPTQ then rounds against Π H Πᵀ); the layer computes Ŵ (Π x). Default: hadamard for the turboquant "
              "and e8 methods, none otherwise; not with awq; written in the quantkit format (quant_method "
              "\"quantkit\"), which GPTQ readers cannot run. --seed picks the signs.", choices=ROTATIONS)
    max_shard_size: str = setting(
        "4GB", "Largest safetensors shard, in bytes or with a unit: KB, MB, GB (powers of 1000), KiB, MiB, GiB (of "
               "1024), e.g. 500MB; bigger checkpoints get several shards and an index.")
    compat: str = setting(  # reader(s) whose refusal is an error before any work
        "none", "Before any work, quantize checks the settings against what vLLM, transformers and GPTQModel load "
                "(bits/sym, group size, short last group, overrides of part of a fused q/k/v or gate/up group, "
                "per-module overrides) and prints one warning line per reader that would refuse the checkpoint, "
                "with the fix. none: warnings only; vllm/transformers/gptqmodel: that reader's refusal is an error; "
                "any: every reader's is. docs/FORMAT.md has the rules and their sources.", choices=COMPAT_TARGETS)
    modules: list = field(default_factory=list)  # the recipe's per-module overrides (no CLI option)
    options: dict = field(default_factory=dict)  # the algorithms' options, every registered one: {name: value}

    def __init__(self, **values):
        declared = algorithm_options()
        own = {f.name: f for f in dataclasses.fields(self)}
        unknown = set(values) - set(own) - set(declared)
        if unknown:
            raise QuantkitError(f"unknown option(s) {sorted(unknown)}: known are {sorted({*own, *declared} - {'options'})}")
        for name, f in own.items():
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(self, name, values.get(name, default))
        given = {**self.options, **{k: v for k, v in values.items() if k in declared}}
        self.options = {name: option.validate(given.get(name, option.default)) for name, option in declared.items()}
        self.__post_init__()

    def __getattr__(self, name):
        """An algorithm's option as an attribute (only reached when `name` is not a field)."""
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"QuantConfig has no option {name!r}")

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
            if f.name in ("gguf_type", "target_bits", "target_size") and getattr(self, f.name) is None:
                continue
            if f.name in ("max_shard_size", "target_size") and is_int(getattr(self, f.name)):
                continue  # a byte count is as good as "4GB"
            expected = {"modules": list, "quantizer": str, "rotate": str, "checkpoint_format": str,
                        "gguf_type": str, "target_bits": float, "target_size": str,
                        "options": dict}.get(f.name, f.type)
            setattr(self, f.name, check_type(getattr(self, f.name), expected, f.name, "option"))
        check_group_size(self.group_size)
        for name in ("nsamples", "seqlen"):
            if getattr(self, name) < 1:
                raise QuantkitError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if not 0 <= self.seed <= MAX_SEED:  # the rotations draw their signs from a 31-bit seed: larger ones alias
            raise QuantkitError(f"--seed {self.seed} is out of range: use an integer from 0 to {MAX_SEED}")
        if self.quantizer not in quantizer_names():
            raise QuantkitError(f"unknown quantizer '{self.quantizer}': choose one of {', '.join(quantizer_names())}")
        implied = spec.quantizer
        if implied and not serves_method(self.quantizer, implied):
            raise QuantkitError(f"--method {self.method} rounds with the {implied} quantizer, not {self.quantizer}: "
                                f"drop --quantizer (or use --method {'gptq' if self.method.endswith('gptq') else 'rtn'} "
                                f"--quantizer {self.quantizer})")
        if self.rotate not in ROTATIONS:
            raise QuantkitError(f"unknown rotation '{self.rotate}': use {' or '.join(ROTATIONS)}")
        unrotated = [a.unrotated_only for a in spec.algorithms() if a.unrotated_only]
        if self.rotate != "none" and unrotated:
            raise QuantkitError(f"--rotate {self.rotate} does not work with --method {self.method}: {unrotated[0]}")
        if self.moe_calibration not in MOE_CALIBRATION:
            raise QuantkitError(f"unknown --moe-calibration '{self.moe_calibration}': use {' or '.join(MOE_CALIBRATION)}")
        if self.compat not in COMPAT_TARGETS:
            raise QuantkitError(f"unknown --compat '{self.compat}': use one of {', '.join(COMPAT_TARGETS)}")
        codecs.codec_of_format(self.checkpoint_format)  # an unknown name is refused with the choices
        self.modules = [self._check_override(o, i) for i, o in enumerate(self.modules)]
        self._check_gguf_type()
        self._check_target_bits()
        self._check_quantizers()

    @property
    def target(self) -> Optional[str]:
        """The budget an allocation meets, as the option that asked for it ("--target-bits 3.5", "--target-size
        80MB"), or None: every layer the run's own settings."""
        if self.target_size is not None:
            return f"--target-size {self.target_size}"
        return None if self.target_bits is None else f"--target-bits {self.target_bits}"

    def without_target(self, modules: list) -> "QuantConfig":
        """This run with its allocation as the recipe's `modules` instead of a target (what OUT's recipe holds)."""
        return dataclasses.replace(self, target_bits=None, target_size=None, modules=modules)

    def _check_target_bits(self) -> None:
        if self.target is None:
            return
        if self.target_bits is not None and self.target_size is not None:
            raise QuantkitError("--target-bits and --target-size are two budgets for one choice: give one of them")
        if self.target_size is not None:
            parse_size(self.target_size, "--target-size")
        elif not 0 < self.target_bits <= 16:
            raise QuantkitError(f"--target-bits {self.target_bits} is out of range: give the bits per weight of the "
                                "quantized linears, e.g. 3.5")
        option = self.target.split()[0]
        if self.gguf_type is not None:
            if self.gguf_type != "auto":
                raise QuantkitError(f"{option} with a GGUF file: use --gguf-type auto (each tensor's block type "
                                    f"chosen for the budget), not --gguf-type {self.gguf_type} (a fixed mix)")
        elif not (is_method_quantizer(self.quantizer) or self.quantizer == "int"
                  and codecs.codec_of_format(self.checkpoint_format).layer_bits is not None):
            raise QuantkitError(f"{option} chooses integer widths and group sizes for the gptq, gptq_v2 and "
                                "compressed-tensors formats, and the rates of the codebook methods (turboquant, e8, "
                                "trellis): use one of those, or --gguf-type auto for a llama.cpp file")
        if any(k in o for o in self.modules for k in ("bits", "group_size", "block_type")):
            raise QuantkitError(f"{option} chooses every layer's bits and group size: drop the recipe's per-module "
                                "bits / group_size / block_type (skip: true still keeps a layer in float)")

    def _check_gguf_type(self) -> None:
        if self.gguf_type is None:
            if any("block_type" in o for o in self.modules):
                raise QuantkitError("a recipe's block_type (a llama.cpp block type) needs a GGUF file: add --gguf-type "
                                    "(a llama.cpp file type, or auto)")
            return
        if self.gguf_type != "auto":
            gguf_mix.check_file_type(self.gguf_type)
        if self.checkpoint_format != "gguf":
            raise QuantkitError(f"--gguf-type {self.gguf_type} makes a llama.cpp file: use it with --checkpoint-format "
                                f"gguf (or leave --checkpoint-format out), not {self.checkpoint_format}")
        if self.quantizer != "int" or any(k in o for o in self.modules for k in ("bits", "group_size", "sym")):
            raise QuantkitError(f"--gguf-type {self.gguf_type} sets every layer's block type (llama.cpp's mix), "
                                "rounded by rtn, gptq or awq: drop --quantizer (and --method "
                                f"{self.method} if it implies one) and the recipe's per-module bits / group_size / "
                                "sym (block_type: sets one module's type; skip: true keeps it in float)")

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
        if o.get("block_type", "Q4_0") not in gguf_types.TYPES:
            raise QuantkitError(f"{where} block_type {o['block_type']!r} is not a block type quantkit writes: choose one "
                                f"of {', '.join(gguf_types.TYPES)}")
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
                spec.update({k: o[k] for k in ("bits", "group_size", "sym", "block_type") if k in o})
        return LayerSpec(**spec, quantizer_name=self.quantizer)

    def unmatched_overrides(self, names, siblings=None, aliases=None) -> list[str]:
        """The recipe's overrides whose pattern matches none of `names` (a misspelled pattern changes nothing);
        siblings: {name: its fused group's other linears}; aliases: {name: its other names}."""
        siblings, aliases = siblings or {}, aliases or {}
        return [f"recipe modules[{i}] pattern {o['pattern']!r}" for i, o in enumerate(self.modules)
                if not any(self._matches(o, n, siblings.get(n, ()), aliases.get(n, ())) for n in names)]

    def to_dict(self) -> dict:
        """Every setting by name, the algorithms' options among the fields (as recipes and reports hold them)."""
        settings = dataclasses.asdict(self)
        return {**{k: v for k, v in settings.items() if k != "options"}, **settings["options"]}


def config_options() -> list[Option]:
    """Every setting a run takes as an Option (what the CLI offers): QuantConfig's own fields (not `modules`, which
    only a recipe gives), then every registered algorithm's options. Read when asked, so a plugin's are there."""
    own = []
    for f in dataclasses.fields(QuantConfig):
        if "help" in f.metadata:
            meta = f.metadata
            kind = next(t for t in typing.get_args(f.type) or (f.type,) if t is not type(None))
            own.append(Option(f.name, kind, f.default, _now(meta["help"]), tuple(_now(meta["choices"])), meta["flag"]))
    return own + list(algorithm_options().values())


def _now(value):
    return value() if callable(value) else value


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
    known = ({f.name for f in dataclasses.fields(QuantConfig)} - {"options"}) | set(algorithm_options())
    unknown = set(data) - known
    if unknown:
        raise QuantkitError(f"recipe {path} has unknown keys {sorted(unknown)}: allowed are {sorted(known)}")
    return data


def write_recipe(config: QuantConfig, path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))

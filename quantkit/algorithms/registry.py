"""Algorithms and methods by name: what `--method` offers, each registered in the file of its algorithm.

An algorithm is one of two kinds, and one file:
  - a rounding (rtn, gptq): turns one linear's weight into a QuantResult with the layer's quantizer, from its
    calibration statistics (its `observer`) or without data;
  - a preparation (awq): changes a decoder block's weights before its linears are rounded (AWQ folds scales).
Each declares its options (quantkit.core.options.Option): the config accepts them, recipes set them and the CLI
offers them, with no other file naming them.

A method is a rounding, the preparations before it, and the quantizer and rotation it implies when --quantizer /
--rotate are not given. rtn, gptq, awq and awq+gptq are registered by their algorithms' files; a quantizer that
offers a method of its own (quantkit.schemes.base.offer_method: turboquant, e8) gets NAME (rotated round to nearest,
data-free) and NAME+gptq (rotated GPTQ) from that quantizer file alone.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

from quantkit.algorithms.hessian import HessianObserver
from quantkit.core.errors import QuantkitError
from quantkit.core.options import Option
from quantkit.core.registry import Registry
from quantkit.schemes.base import METHOD_QUANTIZERS

ALGORITHMS = Registry("algorithm")
METHODS = Registry("method")


class Algorithm(ABC):
    """The base of every algorithm: its name, its options, and what it needs from the run.

    needs_data: it reads calibration activations (the run then loads calibration text); distributes: its work can
    be spread over processes (summed Hessians), so `--processes` may run it; unrotated_only: why it cannot work
    behind --rotate hadamard, or None when it can."""
    name: str = ""
    options: tuple[Option, ...] = ()
    needs_data: bool = False
    distributes: bool = True
    unrotated_only: Optional[str] = None

    def check_model(self, arch, model_type: str) -> None:
        """Refuse, before any work, a model family the algorithm cannot handle (a QuantkitError naming why)."""


class Rounding(Algorithm):
    """Turns a linear's weight into a QuantResult. The calibration loop feeds `observer(weight)` the layer's inputs
    (the Hessian every method's error report reads); `round` gets it back with the weight (both in the rotated basis
    under --rotate), or None for a data-free run or a routed expert no token reached."""

    def observer(self, weight) -> HessianObserver:
        return HessianObserver(weight)

    @abstractmethod
    def round(self, weight, observer: Optional[HessianObserver], quantizer, group_size: int, config, bias):
        """The layer's QuantResult (on the weight's device)."""

    def act_order(self, config) -> bool:
        """Whether the columns were quantized out of order (what a checkpoint's desc_act says)."""
        return False


class Preparation(Algorithm):
    """Changes a block's weights in place before its linears are rounded; returns a report per group of layers."""
    needs_data = True

    @abstractmethod
    def prepare_block(self, runner, block, prefix: str, arch, config, spec_of) -> dict:
        """Change `block`'s weights in place; {group label: what was found}."""


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    return ALGORITHMS.add(algorithm.name, algorithm)


def algorithm(name: str) -> Algorithm:
    return ALGORITHMS.get_entry(name)


def algorithm_options() -> dict[str, Option]:
    """{name: Option} of every registered algorithm, in registration order; one name means one option."""
    out = {}
    for algo in sorted(ALGORITHMS.values(), key=lambda a: isinstance(a, Preparation)):  # roundings' first
        for option in algo.options:
            if out.setdefault(option.name, option) is not option:
                raise ValueError(f"option {option.name!r} is declared twice ({algo.name} and another algorithm)")
    return out


@dataclass(frozen=True)
class MethodSpec:
    name: str
    rounding: str                    # the registered Rounding that makes its QuantResults
    summary: str                     # one line of --method help
    prepare: tuple[str, ...] = ()    # Preparations run on each block first, in order (awq)
    quantizer: Optional[str] = None  # the quantizer it implies (None: --quantizer, int by default)
    rotate: str = "none"             # its default rotation

    def algorithms(self) -> list[Algorithm]:
        return [algorithm(n) for n in (*self.prepare, self.rounding)]

    @property
    def needs_calibration(self) -> bool:
        return any(a.needs_data for a in self.algorithms())


def register_method(spec: MethodSpec) -> MethodSpec:
    return METHODS.add(spec.name, spec)


def _scheme_methods() -> dict:
    """The methods quantizers offer: NAME and NAME+gptq behind a Hadamard rotation."""
    out = {}
    for name, summary in METHOD_QUANTIZERS.items():
        out[name] = MethodSpec(name, "rtn", quantizer=name, rotate="hadamard",
                               summary=f"Hadamard rotation + {summary}, data-free")
        out[f"{name}+gptq"] = MethodSpec(f"{name}+gptq", "gptq", quantizer=name, rotate="hadamard",
                                         summary=f"the {name} codebook inside GPTQ's error feedback (rotated basis)")
    return out


def all_methods() -> dict:
    """{name: MethodSpec}: the registered methods (data-free first, then by how many algorithms they chain), then
    those the quantizers offer."""
    registered = sorted(METHODS.values(), key=lambda m: (len(m.prepare), m.needs_calibration, m.name))
    return {**{m.name: m for m in registered}, **_scheme_methods()}


def method_names() -> list[str]:
    return list(all_methods())


def method_spec(name: str) -> MethodSpec:
    methods = all_methods()
    if name not in methods:
        raise QuantkitError(f"unknown method {name!r}: choose one of {', '.join(methods)}")
    return methods[name]


def method_help() -> str:
    return "; ".join(f"{m.name}: {m.summary}" for m in all_methods().values())

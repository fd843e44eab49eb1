"""Methods by name: what `--method` offers, each a MethodSpec registered where its algorithm lives.

A method is two switches and two defaults: AWQ's scale search first or not, GPTQ's error feedback or round to
nearest, and the quantizer and rotation it implies when --quantizer / --rotate are not given. rtn, gptq, awq and
awq+gptq are registered by their modules; a quantizer that offers a method of its own
(quantkit.schemes.base.offer_method: turboquant, e8) gets NAME (rotated round to nearest, data-free) and
NAME+gptq (rotated GPTQ) from that quantizer file alone.
"""
from dataclasses import dataclass
from typing import Optional

from quantkit.core.errors import QuantkitError
from quantkit.core.registry import Registry
from quantkit.schemes.base import METHOD_QUANTIZERS

METHODS = Registry("method")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    gptq: bool                       # round inside GPTQ's error feedback (else to nearest)
    summary: str                     # one line of --method help
    awq: bool = False                # search AWQ scales (folded into the model) before rounding
    quantizer: Optional[str] = None  # the quantizer it implies (None: --quantizer, int by default)
    rotate: str = "none"             # its default rotation

    @property
    def needs_calibration(self) -> bool:
        return self.gptq or self.awq


def register_method(spec: MethodSpec) -> MethodSpec:
    return METHODS.add(spec.name, spec)


def _scheme_methods() -> dict:
    """The methods quantizers offer: NAME and NAME+gptq behind a Hadamard rotation."""
    out = {}
    for name, summary in METHOD_QUANTIZERS.items():
        out[name] = MethodSpec(name, gptq=False, quantizer=name, rotate="hadamard",
                               summary=f"Hadamard rotation + {summary}, data-free")
        out[f"{name}+gptq"] = MethodSpec(f"{name}+gptq", gptq=True, quantizer=name, rotate="hadamard",
                                         summary=f"the {name} codebook inside GPTQ's error feedback (rotated basis)")
    return out


def all_methods() -> dict:
    """{name: MethodSpec}: the registered methods (rtn, gptq, awq, awq+gptq: by AWQ, then GPTQ), then those the
    quantizers offer."""
    registered = sorted(METHODS.values(), key=lambda m: (m.awq, m.gptq, m.name))
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

"""Option: one setting of a quantization run, declared once where it is used.

An algorithm (quantkit.algorithms.registry) declares its own options; the run's config (quantkit.run.config)
accepts them by name, recipes set them by the same name, and the CLI builds `--name-with-dashes` from the
declaration (type, default, help, choices). Nothing else repeats them.
"""
from dataclasses import dataclass
from typing import Any, Callable, Optional

from quantkit.core.errors import QuantkitError

_TYPE_WORDS = {bool: "true or false, without quotes", int: "a whole number, without quotes",
               float: "a number, without quotes", str: "a string (in quotes)", list: "a list of '- pattern: ...' items"}


def is_int(value) -> bool:
    """An integer that is not a bool (YAML/JSON booleans are ints to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_type(value, expected, key: str, where: str = "recipe"):
    """`value` as `expected` (an int is fine for a float), or a QuantkitError: a quoted 'false' is no boolean."""
    if expected is float and is_int(value):
        return float(value)
    if not (is_int(value) if expected is int else isinstance(value, expected)):
        raise QuantkitError(f"{where} {key} must be {_TYPE_WORDS[expected]}; got {value!r} ({type(value).__name__})")
    return value


@dataclass(frozen=True)
class Option:
    """name: the config field and recipe key (the CLI flag is --name with dashes); type: bool, int, float or str;
    help: one paragraph of --help; choices: the values allowed (empty: any of the type); flag: the CLI's
    spelling when it is not --name (a bool's "--sym/--asym"); check: the value -> a problem (a str) or None."""
    name: str
    type: type
    default: Any
    help: str
    choices: tuple = ()
    flag: Optional[str] = None
    check: Optional[Callable[[Any], Optional[str]]] = None

    @property
    def cli_flag(self) -> str:
        dashed = "--" + self.name.replace("_", "-")
        return self.flag or (f"{dashed}/--no-{dashed[2:]}" if self.type is bool else dashed)

    def validate(self, value):
        """The value, type-checked, or a QuantkitError naming the option and what it accepts."""
        value = check_type(value, self.type, self.name, "option")
        if self.choices and value not in self.choices:
            raise QuantkitError(f"unknown --{self.name.replace('_', '-')} {value!r}: use one of "
                                f"{', '.join(map(str, self.choices))}")
        problem = self.check(value) if self.check else None
        if problem:
            raise QuantkitError(f"--{self.name.replace('_', '-')} {value}: {problem}")
        return value


def positive(value) -> Optional[str]:
    """A check for counts: None when value >= 1."""
    return None if value >= 1 else "must be a positive integer"

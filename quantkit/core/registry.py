"""Registries: name -> entry tables that the files defining the entries fill with a decorator.

Quantizers (quantkit.schemes), methods (quantkit.algorithms) and checkpoint codecs (quantkit.checkpoint.codecs)
each keep one. A package imports every module it holds (import_all), so a new quantizer or codec is one file
that registers itself; the CLI's choices, the config's validation and the help texts read the tables.
"""
import importlib
import pkgutil

from quantkit.core.errors import QuantkitError


class Registry(dict):
    """{name: entry} of one kind ("quantizer", "method", "codec"); get() names the choices when a name is unknown."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def add(self, name: str, entry):
        """Register `entry` under `name`; a second entry under one name is a programming error."""
        if name in self and self[name] is not entry:
            raise ValueError(f"{self.kind} {name!r} is registered twice ({self[name]!r} and {entry!r})")
        self[name] = entry
        return entry

    def decorator(self, attribute: str = "name"):
        """A class decorator registering the class under its `attribute` (e.g. Grid.name == "int")."""
        return lambda cls: self.add(getattr(cls, attribute), cls)

    def get_entry(self, name: str):
        if name not in self:
            raise QuantkitError(f"unknown {self.kind} {name!r}: this version knows {', '.join(sorted(self))}")
        return self[name]


def import_all(package_name: str, package_path) -> None:
    """Import every module of a package (its __init__ calls this), so each registers what it defines."""
    for module in pkgutil.iter_modules(package_path):
        importlib.import_module(f"{package_name}.{module.name}")

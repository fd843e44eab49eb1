"""Quantizers, one file each; importing the package registers them all (quantkit.schemes.base)."""
from quantkit.core.registry import import_all

import_all(__name__, __path__)

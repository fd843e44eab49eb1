"""Quantizers, one file each; importing the package registers them all (quantkit.schemes.base). llama.cpp's block
types are quantizers too, kept with the rest of its format in quantkit.gguf, which registers them when imported."""
from quantkit.core.registry import import_all

import_all(__name__, __path__)

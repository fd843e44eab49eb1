"""Checkpoint folders: one codec per quant_method (registered in its own file), the files and shards they live in,
validation, the readers' compatibility rules. Importing the package registers every codec here; the GGUF codec lives
with the rest of llama.cpp's format in quantkit.gguf, a layer above, which registers it when imported."""
from quantkit.core.registry import import_all

import_all(__name__, __path__)

"""Checkpoint folders: one codec per quant_method (registered in its own file), the files and shards they live in,
validation, the readers' compatibility rules. Importing the package registers every codec."""
from quantkit.core.registry import import_all

import_all(__name__, __path__)

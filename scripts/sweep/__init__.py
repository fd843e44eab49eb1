"""The stages of scripts/family_sweep.py, one module each.

common.py      what every stage shares: the auto class of a config, quiet construction, one-line errors
shrink.py      a family's default config dict shrunk by one table of field names, and constructed again
layers.py      the fewest decoder layers that keep every kind of layer the default has
tiny_build.py  tiny_config and build_tiny: the shrunk, cut config built, filled and checked
heldout.py     the held-out token ids the fp and the quantized models are compared on
children.py    the child processes (build, check) and how the parent runs them
coverage.py    the quantized share counted again from a checkpoint's safetensors headers
"""

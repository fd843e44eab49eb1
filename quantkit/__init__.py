"""quantkit: offline weight quantization for Hugging Face causal LMs."""
from quantkit.core.version import __version__  # noqa: F401

_PUBLIC = {"quantize": "quantkit.api", "load_quantized": "quantkit.api", "convert": "quantkit.api",
           "QuantConfig": "quantkit.run.config", "QuantkitError": "quantkit.core.errors"}


def __getattr__(name):  # keep `import quantkit` light: torch/transformers load on first use
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(name)

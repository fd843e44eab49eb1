"""quantkit: offline weight quantization for Hugging Face causal LMs."""
__version__ = "0.1.0"


def __getattr__(name):  # keep `import quantkit` light: torch/transformers load on first use
    if name in ("quantize", "load_quantized"):
        from quantkit import api

        return getattr(api, name)
    raise AttributeError(name)

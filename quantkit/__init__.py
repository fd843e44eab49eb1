"""quantkit: offline weight quantization for Hugging Face causal LMs."""
from quantkit.core.version import __version__  # noqa: F401
# llama.cpp's quantizers and GGUF codec register into quantkit.schemes' and quantkit.checkpoint's registries from a
# layer above both, which neither package imports: every use of quantkit sees them from here
from quantkit import gguf  # noqa: F401

_PUBLIC = {"quantize": "quantkit.api", "load_quantized": "quantkit.api", "convert": "quantkit.api",
           "QuantConfig": "quantkit.run.config", "QuantkitError": "quantkit.core.errors"}


def command_line():
    """The `quantkit` console script. Importing the CLI imports torch (seconds): Ctrl-C meanwhile ends as click ends
    an interrupted command, with "Aborted!" and exit code 1, not a traceback."""
    try:
        from quantkit.cli import main
    except KeyboardInterrupt:
        import sys

        print("\nAborted!", file=sys.stderr)
        raise SystemExit(1) from None
    main()


def _register_with_transformers():
    """quant_method "quantkit" in transformers' quantizer registry (quantkit.integrations.transformers), so that
    AutoModelForCausalLM.from_pretrained loads quantkit-format folders once quantkit is imported. This imports
    transformers (about 2 s), which every use of quantkit needs anyway; without transformers, nothing to register."""
    try:
        from quantkit.integrations.transformers import register
    except ImportError:
        return
    register()


_register_with_transformers()


def __getattr__(name):  # keep `import quantkit` light: torch/transformers load on first use
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(name)

"""Python API: quantize() a model into a checkpoint folder, load_quantized() it back, convert() between layouts.

    import quantkit
    report = quantkit.quantize("HuggingFaceTB/SmolLM2-135M", "out", quantkit.QuantConfig(method="gptq"))
    model = quantkit.load_quantized("out")   # on the GPU when there is one, in the checkpoint's dtype

Every user mistake is a quantkit.QuantkitError whose message names the input and the fix.
"""
from quantkit.checkpoint.files import RECIPE_NAME, REPORT_NAME  # noqa: F401  (public API)
from quantkit.core.errors import QuantkitError  # noqa: F401
from quantkit.run.config import QuantConfig  # noqa: F401
from quantkit.run.convert import convert  # noqa: F401
from quantkit.run.load import load_quantized  # noqa: F401
from quantkit.run.pipeline import quantize  # noqa: F401

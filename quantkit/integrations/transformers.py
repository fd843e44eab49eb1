"""quant_method "quantkit" in transformers' own quantizer registry: once quantkit is imported,

    model = AutoModelForCausalLM.from_pretrained(folder)

loads a quantkit-format folder (codebook, rotated, integer or mixed layers: quantkit.checkpoint.quantkit_format) with
the modules load_quantized builds, and `save_pretrained` writes it back in the same format.

transformers (5.24, quantizers/auto.py and base.py) builds the model on the meta device, calls the quantizer's
`_process_model_before_weight_loading`, then loads every checkpoint tensor into the module that has its name: so the
quantizer only swaps each listed linear for its quantkit module, whose buffers carry the checkpoint's tensor names.
What transformers does not do for such modules, the hook after loading does: the tables a codebook layer computes from
its settings (not stored) are built on the layer's device.

Not covered here, and refused by name: experts that the model holds fused (quantkit splits them, which transformers'
loader does not know), and layers renamed by a model's key mapping; quantkit.load_quantized loads both.
"""
import torch
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          register_quantization_config, register_quantizer)
from transformers.utils.quantization_config import QuantizationConfigMixin

from quantkit.checkpoint.quantkit_format import QuantkitCodec
from quantkit.checkpoint.validate import LayerInfo
from quantkit.core.errors import QuantkitError
from quantkit.models.arch import get_weight
from quantkit.nn.decoded_linear import DecodedLinear

METHOD = "quantkit"


class QuantkitConfig(QuantizationConfigMixin):
    """A folder's quantization_config as written (format_version, layers, the run's options), kept whole so that
    save_pretrained writes it back unchanged."""

    def __init__(self, **fields):
        self.__dict__.update(fields)
        self.quant_method = METHOD


class QuantkitHfQuantizer(HfQuantizer):
    """Loads quantkit-format folders (quantizing is quantkit.quantize's job, hence requires_calibration)."""

    requires_calibration = True

    def _process_model_before_weight_loading(self, model, **kwargs):
        qc = self.quantization_config.to_dict()
        # transformers runs this under torch.device("meta"); the quantizers' own tables (codebooks) must be real:
        # the modules' buffers are put on the meta device explicitly
        with torch.device("cpu"):
            QuantkitCodec.check_config(qc, "quantization_config")
            for name, settings in qc["layers"].items():
                _swap(model, name, settings, qc)

    def _process_model_after_weight_loading(self, model, **kwargs):
        for module in model.modules():
            if isinstance(module, DecodedLinear):
                module.build_codebook(module.codes.device)
        return model

    def is_serializable(self, *args, **kwargs):
        return True

    @property
    def is_trainable(self):
        return False


def _swap(model, name: str, settings: dict, qc: dict) -> None:
    """The linear `name` becomes the module its settings describe, on the meta device, shaped as the model's."""
    try:
        module = model.get_submodule(name)
        n, k = get_weight(module).shape
    except (AttributeError, TypeError):
        raise QuantkitError(f"quantization_config lists {name}, which {type(model).__name__} as transformers builds it "
                            "has no linear of (fused experts, or a renamed layer): load the folder with "
                            "quantkit.load_quantized") from None
    bias = getattr(module, "bias", None) is not None
    layer = LayerInfo(name, k, n, {"rotation": None, **settings}, bias)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, QuantkitCodec.build_module(layer, qc, get_weight(module).dtype))


def register() -> None:
    """Put quant_method "quantkit" in transformers' registries (once: a second registration raises there)."""
    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(QuantkitConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(QuantkitHfQuantizer)

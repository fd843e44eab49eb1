"""load_quantized: a quantized checkpoint folder -> a transformers model with QuantLinear modules.

config.json -> model skeleton with parameters on the meta device (buffers such as rotary tables are
real) -> each module that has a `.qweight` in the checkpoint becomes a QuantLinear -> tensors are
assigned (no full-precision copy of quantized weights is ever made) -> tied weights re-tied.
"""
from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import bitpack, checkpoint
from quantkit.formats.gptq import module_settings
from quantkit.model.loader import parse_dtype
from quantkit.model.sequential import get_weight
from quantkit.nn.quant_linear import QuantLinear


def _device(device_map):
    if device_map in (None, "cpu"):
        return "cpu"
    if device_map == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device_map, (str, torch.device)):
        return str(device_map)
    raise QuantkitError(f"device_map {device_map!r} is not supported: use None, 'auto', 'cpu' or a device like 'cuda:0'")


def _default_dtype(config_dtype, device):
    """fp32 on CPU (fast and exact there); on GPU the checkpoint's half type, fp16 otherwise."""
    if device == "cpu":
        return torch.float32
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.float16


def _skeleton(folder, dtype):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    qc = config.quantization_config
    del config.quantization_config  # keep transformers from looking for a GPTQ backend
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.quantization_config = qc
    return model, qc


def _swap_quantized(model, tensors, qc, dtype):
    names = sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))
    if not names:
        raise QuantkitError("the checkpoint holds no quantized layers (.qweight tensors): quantize the model again")
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError as e:
            raise QuantkitError(f"checkpoint layer {name} does not exist in the model built from config.json") from e
        bits, group_size, _ = module_settings(qc, name)
        n, k = get_weight(module).shape   # also meta tensors: only the shape is read
        if tuple(tensors[f"{name}.qweight"].shape) != (bitpack.packed_len(k, bits), n):
            raise QuantkitError(f"{name}.qweight has shape {tuple(tensors[f'{name}.qweight'].shape)}, not the "
                                f"{bits}-bit layout of a {k}->{n} linear: the checkpoint and its config disagree")
        q = QuantLinear(k, n, bits, group_size, f"{name}.bias" in tensors, qc.get("checkpoint_format", "gptq"),
                        dtype=dtype, device="meta")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, q)


def load_quantized(path, device_map=None, dtype=None):
    """Load a quantkit/GPTQ-layout checkpoint folder as a transformers model in eval mode.

    device_map: None or "cpu" (CPU), "auto" (the GPU when there is one) or a device string.
    dtype: activation/float-parameter dtype; default fp32 on CPU, fp16/bf16 on GPU.
    """
    folder = Path(path)
    config = checkpoint.read_config(folder)
    device = _device(device_map)
    dtype = parse_dtype(dtype) or _default_dtype(parse_dtype(config.get("dtype") or config.get("torch_dtype")), device)
    tensors = checkpoint.read_tensors(folder)
    model, qc = _skeleton(folder, dtype)
    _swap_quantized(model, tensors, qc, dtype)
    for name, t in tensors.items():
        if t.is_floating_point() and not name.endswith(".scales"):
            tensors[name] = t.to(dtype)
    result = model.load_state_dict(tensors, strict=False, assign=True)
    if result.unexpected_keys:
        raise QuantkitError(f"checkpoint has tensors the model does not: {result.unexpected_keys[:5]}")
    model.tie_weights()
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta"]
    if missing:
        raise QuantkitError(f"checkpoint is missing tensors {missing[:5]}: it is incomplete, quantize again")
    return model.to(device).eval()

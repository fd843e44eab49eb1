"""load_quantized: a quantized checkpoint folder -> a transformers model with quantized linear modules.

config.json -> the codec of its quant_method checks config and tensors (quantkit.checkpoint.codecs) ->
model skeleton with parameters on the meta device (buffers such as rotary tables are real) -> each
quantized layer becomes the module its codec builds (QuantLinear for the GPTQ layout) -> tensors are
assigned (no full-precision copy of quantized weights is ever made) -> tied weights re-tied -> on the CPU, the
layers torch's int4 GEMM can take are repacked for it (quantkit.nn.cpu_int4_linear).
"""
import dataclasses
from pathlib import Path

import torch

from quantkit.calibration.sequential import move_loaded
from quantkit.checkpoint import files as checkpoint
from quantkit.core.errors import QuantkitError
from quantkit.models import offload, placement
from quantkit.models.arch import arch_for, get_weight
from quantkit.models.hub import model_class, parse_dtype, resolve_device
from quantkit.models.moe import split_experts
from quantkit.models.names import FileNames
from quantkit.nn.cpu_int4_linear import repack_for_cpu


def _device(device_map):
    if device_map is None:
        return "cpu"
    if device_map == "balanced":
        return resolve_device("cuda")
    if isinstance(device_map, (str, torch.device)):
        return resolve_device(str(device_map))
    raise QuantkitError(f"device_map {device_map!r} is not supported: use None, 'auto', 'balanced', 'cpu' or a "
                        "device like 'cuda:0'")


def _default_dtype(config_dtype, device):
    """fp32 on CPU (fast and exact there); on GPU the checkpoint's half type, fp16 otherwise."""
    if device == "cpu":
        return torch.float32
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.float16


def _skeleton(folder, dtype, qc):
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise QuantkitError(f"{folder}/config.json does not describe a model transformers knows ({e}): "
                            "restore it from the source model") from e
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # keep transformers from looking for a GPTQ backend
    with init_empty_weights(include_buffers=False):
        model = model_class(config).from_config(config, dtype=dtype)
    split_experts(model)  # as quantize split them: one linear per expert
    model.config.quantization_config = qc
    return model, qc


def _swap_quantized(model, layers, codec, qc, dtype):
    for layer in layers:
        name = layer.name
        try:
            module = model.get_submodule(name)
        except AttributeError as e:
            raise QuantkitError(f"checkpoint layer {name} does not exist in the model built from config.json") from e
        n, k = get_weight(module).shape   # also meta tensors: only the shape is read
        if (layer.in_features, layer.out_features) != (k, n):
            raise QuantkitError(f"checkpoint layer {name} is {layer.in_features}->{layer.out_features} but the model "
                                f"built from config.json has a {k}->{n} linear there: the checkpoint and its config disagree")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, codec.build_module(layer, qc, dtype))


def load_quantized(path, device_map=None, dtype=None, stream=False, cache_dequantized=False):
    """Load a quantkit/GPTQ-layout checkpoint folder as a transformers model in eval mode.

    device_map: None or "cpu" (CPU), "auto" (the GPU when there is one; the decoder blocks spread over all
        visible GPUs when the model does not fit on one, quantkit.models.placement), "balanced" (spread over all
        GPUs in any case) or a device string such as "cuda:1".
    dtype: activation/float-parameter dtype; default fp32 on CPU, fp16/bf16 on GPU.
    stream: keep the decoder blocks (and an untied lm_head) in the files and read each one when its forward
        runs (quantkit.models.offload): memory ≈ the embedding + one block, for checkpoints larger than
        memory; every forward reads the blocks again, so it is slower (fine for evaluation, slow for generate).
    cache_dequantized: on the CPU, keep each quantized linear's decoded weight after its first forward (as fast as
        the unquantized model at float32, and as big). By default the weights stay packed: the layers torch's CPU
        int4 GEMM takes are repacked for it (fast token-by-token decode with dtype=torch.bfloat16), and every other
        call decodes a bounded strip of the weight at a time (exact, float32's default).
    """
    folder = Path(path)
    device = _device(device_map)  # before the files are read: a mistyped device is named at once
    config, tensors, layers, codec = checkpoint.read_checkpoint(folder)
    dtype = parse_dtype(dtype) or _default_dtype(parse_dtype(config.get("dtype") or config.get("torch_dtype")), device)
    qc = config["quantization_config"]  # config.json's, or an AutoGPTQ folder's quantize_config.json
    model, qc = _skeleton(folder, dtype, qc)
    in_files = FileNames(model)  # the files name tensors as transformers saves them (quantkit.models.names)
    tensors = {in_files.to_model(n): t for n, t in tensors.items()}
    layers = [dataclasses.replace(layer, name=in_files.to_model(layer.name)) for layer in layers]
    blocks_path = arch_for(model).blocks  # before the swap: an unknown family's blocks are found by their linears
    _swap_quantized(model, layers, codec, qc, dtype)
    units = []
    if stream:
        files = checkpoint.tensor_files(folder)

        def read(names):
            return {in_files.to_model(n): t
                    for n, t in checkpoint.read_tensors(folder, [in_files.of_tensor(n) for n in names], files).items()}
        units = offload.stream_model(model, blocks_path, read, {in_files.to_model(n) for n in files}, device)
        tensors = {n: t for n, t in tensors.items() if not offload.under(n, units)}  # their views (pages) go
    buffers = dict(model.named_buffers())
    wide = {f"{layer.name}.scales" for layer in layers if layer.scale_dtype != torch.float16}  # kept as stored
    for name, t in tensors.items():  # float tensors take the activation dtype, unless the module keeps its own
        if t.is_floating_point() and name not in wide and not (name in buffers and buffers[name].dtype != dtype):
            tensors[name] = t.to(dtype)
    try:
        result = model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[-1].strip()
        raise QuantkitError(f"the tensors of {folder} do not fit the model its config.json describes ({first}): "
                            "the checkpoint is damaged, quantize again") from e
    if result.unexpected_keys:
        raise QuantkitError(f"checkpoint has tensors the model does not: {result.unexpected_keys[:5]}")
    model.tie_weights()
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
               if p.device.type == "meta" and not offload.under(n, units)]
    if missing:
        raise QuantkitError(f"checkpoint is missing tensors {missing[:5]}: it is incomplete, quantize again")
    del tensors, result  # the GPTQ tensors now live in the modules only: a repacked layer frees them
    if stream:
        move_loaded(model, device)
        return model.eval()
    if device_map in ("auto", "balanced") and device == "cuda":
        return placement.place_on_gpus(model.eval(), blocks_path, always=device_map == "balanced")
    if device == "cpu":
        _cpu_layers(model, cache_dequantized)
    return model.to(device).eval()


def _cpu_layers(model, cache_dequantized: bool) -> None:
    if not cache_dequantized:
        repack_for_cpu(model)
        return
    for module in model.modules():
        if hasattr(module, "cache_dequantized"):
            module.cache_dequantized = True


"""load_quantized: a quantized checkpoint folder -> a transformers model with quantized linear modules.

config.json -> the codec of its quant_method checks config and tensors (quantkit.checkpoint.codecs) ->
model skeleton with parameters on the meta device (buffers such as rotary tables are real) -> each
quantized layer becomes the module its codec builds (QuantLinear for the GPTQ layout) -> tensors are read
into memory of their own and assigned one quantized layer at a time (no full-precision copy of quantized weights
is ever made), and on the CPU each layer torch's int4 GEMM can take is repacked for it as soon as it is in
(quantkit.nn.cpu_int4_linear) -> tied weights re-tied.
"""
import dataclasses
import sys
from collections import Counter
from pathlib import Path

import torch

from quantkit.checkpoint import codecs
from quantkit.checkpoint import files as checkpoint
from quantkit.checkpoint.reads import TensorReader
from quantkit.core.errors import QuantkitError
from quantkit.kernels.dispatch import layer_backend
from quantkit.models import offload, placement
from quantkit.models.arch import arch_for, get_weight
from quantkit.models.hub import DTYPES, model_class, resolve_device
from quantkit.models.moe import split_experts
from quantkit.models.names import FileNames
from quantkit.models.placement import move_loaded
from quantkit.models.sliced import split_in_files, split_sliced
from quantkit.nn.cpu_int4_linear import repack_layer
from quantkit.nn.quant_linear import QuantLinear

SPREADS = ("auto", "balanced")  # device_map values that spread the decoder blocks over the GPUs


def _one_device(value, name: str) -> str:
    """A single device as a string: "cpu", "cuda", "cuda:1", "auto", a torch.device, or an int as torch reads it
    (1 is "cuda:1"); resolve_device then checks it against this machine."""
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise QuantkitError(f"load_quantized({name}={value!r}): give a device such as 'cpu', 'cuda' or 'cuda:1' (a "
                            "torch.device or a GPU index too), or 'auto'")
    return f"cuda:{value}" if isinstance(value, int) else str(value)


def _map_device(device_map) -> str:
    """The one device a device_map names: a device, or a dict whose values all name the same device (transformers'
    {"": 0}); a dict that spreads modules over devices is refused (the spread quantkit makes is "auto"/"balanced")."""
    if not isinstance(device_map, dict):
        return _one_device(device_map, "device_map")
    devices = {_one_device(v, "device_map") for v in device_map.values()}
    if len(devices) != 1:
        raise QuantkitError(f"load_quantized(device_map={device_map!r}): a map over several devices is not supported: "
                            "use device_map='auto' (the decoder blocks spread over the GPUs when the model does not "
                            "fit one) or 'balanced' (spread in any case), or one device")
    return devices.pop()


def _same_device(a: str, b: str) -> bool:
    """cuda and cuda:0 are the same device here (the loader's GPU is the first one unless an index says otherwise)."""
    (kind_a, _, index_a), (kind_b, _, index_b) = a.partition(":"), b.partition(":")
    return kind_a == kind_b and (index_a or "0") == (index_b or "0")


def placement_of(device=None, device_map=None) -> tuple:
    """(the device a model loads on, None or the spread over GPUs: "auto" or "balanced") for load_quantized's device
    and device_map; both given must agree (device None or "auto" leaves the choice to device_map). Neither given:
    the CPU, as transformers' from_pretrained."""
    if device is None and device_map is None:
        return "cpu", None
    device = _one_device("auto" if device is None else device, "device")
    if device_map is None:
        return resolve_device(device), None
    spread = device_map if isinstance(device_map, str) and device_map in SPREADS else None
    mapped = spread or _map_device(device_map)
    if device != "auto" and (spread or not _same_device(device, mapped)):
        raise QuantkitError(f"load_quantized got device={device!r} and device_map={device_map!r}, which disagree: give "
                            "one of them (device: one device; device_map: 'auto' or 'balanced' to spread the decoder "
                            "blocks over the GPUs, or one device)")
    return resolve_device("cuda" if spread == "balanced" else mapped), spread


def _dtype_arg(dtype):
    """"auto" or the torch dtype that load_quantized's dtype names (a torch dtype, or a name: "bfloat16", "bf16",
    "torch.float16" ...)."""
    if dtype is None or isinstance(dtype, str) and dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and isinstance(DTYPES.get(dtype.removeprefix("torch.")), torch.dtype):
        return DTYPES[dtype.removeprefix("torch.")]
    raise QuantkitError(f"load_quantized(dtype={dtype!r}): use 'auto' (the checkpoint's own dtype), a floating torch "
                        f"dtype, or one of {', '.join(n for n in DTYPES if n != 'auto')}")


def checkpoint_dtype(config: dict, tensors=None, layers=()) -> torch.dtype:
    """The dtype a checkpoint's model is in (what dtype="auto" loads, as transformers does): config.json's `dtype`
    (`torch_dtype` before transformers 5); else the dtype of most of the float tensors outside its quantized layers
    (the embeddings, norms); else float32."""
    declared = DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))
    if isinstance(declared, torch.dtype):
        return declared
    quantized = {layer.name for layer in layers}
    sizes = Counter()
    for name, t in (tensors or {}).items():
        if t.is_floating_point() and name.rpartition(".")[0] not in quantized:
            sizes[t.dtype] += t.numel()
    return sizes.most_common(1)[0][0] if sizes else torch.float32


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


def load_quantized(path, device=None, device_map=None, dtype="auto", stream=False, cache_dequantized=False,
                   torch_dtype=None):
    """Load a quantkit/GPTQ-layout checkpoint folder as a transformers model in eval mode.

    device: the one device it runs on: "cpu", "cuda", "cuda:1", a torch.device (or a GPU index); "auto": the GPU
        when there is one, else the CPU. Neither device nor device_map given: the CPU, as transformers loads.
    device_map: as transformers': "auto" (the GPU when there is one; the decoder blocks spread over all visible GPUs
        when the model does not fit one, quantkit.models.placement), "balanced" (spread over all GPUs in any case),
        one device, or a dict naming one device ({"": 0}). Given with a device other than "auto", the two must agree.
    dtype: the float parameters' and activations' dtype: "auto" (the default, as transformers 5 has it) is the
        checkpoint's own (checkpoint_dtype: config.json's, else its float tensors'); a torch dtype or a name
        ("bfloat16", "fp16", "float32" ...). On the CPU, bfloat16 runs torch's int4 GEMM for decode steps; float32 is
        the exact one (what `quantkit eval` computes in there by default). torch_dtype: transformers' older spelling.
    stream: keep the decoder blocks (and an untied lm_head) in the files and read each one when its forward
        runs (quantkit.models.offload): memory ≈ the embedding + one block, for checkpoints larger than
        memory; every forward reads the blocks again, so it is slower (fine for evaluation, slow for generate).
    cache_dequantized: on the CPU, keep each quantized linear's decoded weight after its first forward (as fast as
        the unquantized model at float32, and as big). By default the weights stay packed: what runs each layer is
        kernels.dispatch.layer_backend's choice (`quantkit inspect` shows it): on the CPU, the layers torch's int4
        GEMM takes are repacked for it, and every other call decodes a bounded strip of the weight at a time.
    """
    folder = Path(path)
    device, spread = placement_of(device, device_map)  # before the files are read: a mistyped device is named at once
    cache_dequantized = cache_dequantized and device == "cpu"  # on a GPU the kernels decode in registers
    dtype = _dtype_arg(_one_of("dtype", dtype, "torch_dtype", torch_dtype))
    config = checkpoint.read_config(folder)
    codec = codecs.codec_named(config["quantization_config"], str(folder))
    if not codec.safetensors:  # one file of another tool's (GGUF): its weights decoded, a float model
        if stream:
            print(f"note: {folder} is a {codec.quant_method} checkpoint: it is loaded whole, dequantized (--stream "
                  "reads safetensors checkpoints)", file=sys.stderr)
        return _load_dequantized(folder, config, codec, device, checkpoint_dtype(config) if dtype == "auto" else dtype)
    config, tensors, layers, codec, stored = checkpoint.read_checkpoint_as_stored(folder)
    dtype = checkpoint_dtype(config, tensors, layers) if dtype == "auto" else dtype
    model, blocks_path, units = _load_safetensors(folder, config, tensors, layers, codec, stored, device, dtype,
                                                  stream, cache_dequantized)
    if stream:
        move_loaded(model, device)
        return model.eval()
    if spread and device == "cuda":
        return placement.place_on_gpus(model.eval(), blocks_path, always=spread == "balanced")
    if cache_dequantized:  # its layers stayed packed as read (layer_backend: "dense"); each keeps its decode
        for module in model.modules():
            if hasattr(module, "cache_dequantized"):
                module.cache_dequantized = True
    return model.to(device).eval()


def _one_of(name, value, alias, alias_value):
    """The value given under `name` or under its alias `alias`: both given and different is a mistake."""
    if alias_value is None:
        return value
    if value not in (None, "auto") and str(value) != str(alias_value):
        raise QuantkitError(f"load_quantized got {name}={value!r} and {alias}={alias_value!r}: give one of them")
    return alias_value


def _load_safetensors(folder, config, tensors, layers, codec, stored, device, dtype, stream, cache_dequantized):
    """(model with every tensor in, or streamed; the blocks' path; the streamed units) of a safetensors checkpoint."""
    qc = config["quantization_config"]  # config.json's, or an AutoGPTQ folder's quantize_config.json
    model, qc = _skeleton(folder, dtype, qc)
    in_files = FileNames(model)  # the files name tensors as transformers saves them (quantkit.models.names)
    as_read, tensors = tensors, {in_files.to_model(n): t for n, t in tensors.items()}
    as_read.clear()  # the caller's dict too: the views (and the pages validation read through them) go with `tensors`
    layers = [dataclasses.replace(layer, name=in_files.module_to_model(layer.name)) for layer in layers]
    split_sliced(model, split_in_files(model, tensors))  # as quantize split them (quantkit.models.sliced)
    blocks_path = arch_for(model).blocks  # before the swap: an unknown family's blocks are found by their linears
    _swap_quantized(model, layers, codec, qc, dtype)
    units, keep = [], _kept_dtypes(model, layers, dtype)

    def as_loaded(name, stored_dtype):  # float tensors take the activation dtype, unless the module keeps its own
        return dtype if stored_dtype.is_floating_point and name not in keep else stored_dtype

    if stream:
        carried = set(checkpoint.carried_tensors(folder))  # not the model's (MTP layers)
        files = {n: f for n, f in checkpoint.tensor_files(folder).items() if n not in carried}

        def read(names):
            return {in_files.to_model(n): t
                    for n, t in checkpoint.read_tensors(folder, [in_files.of_tensor(n) for n in names], files).items()}
        units = offload.stream_model(model, blocks_path, read, {in_files.to_model(n) for n in files}, device)
        _assign(model, folder, {n: t.to(as_loaded(n, t.dtype)) for n, t in tensors.items()
                                if not offload.under(n, units)})  # the streamed blocks' views (pages) go
    else:
        def runs_on_int4(name):  # what runs the layer is the dispatcher's choice (kernels.dispatch)
            module = model.get_submodule(name)
            return isinstance(module, QuantLinear) and \
                layer_backend(module.facts(), device, dtype, cache_dequantized).name == "cpu_int4"
        stored = {in_files.to_model(n) for n in stored}
        _read_layer_by_layer(model, folder, tensors, stored, stored & _kept_as_views(model, tensors, device, as_loaded),
                             layers, in_files, as_loaded, runs_on_int4, dtype)
    _check_complete(model, units)
    return model, blocks_path, units


def _load_dequantized(folder: Path, config: dict, codec, device: str, dtype) -> torch.nn.Module:
    """A checkpoint whose codec reads its weights back only as float tensors (GGUF), into a float model."""
    model, _ = _skeleton(folder, dtype, config["quantization_config"])
    del model.config.quantization_config  # the model is a float one now: save_pretrained must not call it quantized
    _assign(model, folder, codec.read_dequantized(folder, config, dtype))
    _check_complete(model)
    return model.to(device).eval()


def _check_complete(model, units=()) -> None:
    """Tied weights re-tied, then every parameter and buffer real (the streamed `units` aside)."""
    model.tie_weights()
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
               if p.device.type == "meta" and not offload.under(n, units)]
    if missing:
        raise QuantkitError(f"checkpoint is missing tensors {missing[:5]}: it is incomplete, quantize again")


def _kept_dtypes(model, layers, dtype) -> set:
    """Names of the float tensors loaded as stored: scales that float16 does not hold (quantkit.checkpoint.codecs)
    and buffers a module keeps in a dtype of its own."""
    keep = {f"{layer.name}.scales" for layer in layers if layer.scale_dtype != torch.float16}
    return keep | {n for n, b in model.named_buffers() if b.is_floating_point() and b.dtype != dtype}


def _read_layer_by_layer(model, folder, tensors: dict, stored: set, mapped: set, layers, in_files, as_loaded,
                         runs_on_int4, dtype):
    """One quantized layer at a time, and each layer that `runs_on_int4` repacked for the CPU's int4 GEMM (for `dtype`
    activations) as soon as its tensors are in: the load's peak is the loaded model plus one layer, not the files'
    pages plus float copies plus every layer's GPTQ tensors. `tensors` are views of the memory-mapped files, which
    validated them; the `stored` ones (not rewritten by the codec) are read again into memory of their own
    (quantkit.checkpoint.reads), or mapped alone (the `mapped` ones), so their views are dropped first: with them go
    the files' maps and every page the check made resident (16 MB on SmolLM2, 55 MB on a 2 B-weight Llama), before
    the layers come in."""
    reader = TensorReader(checkpoint.shard_files(folder))
    dtypes = {name: view.dtype for name, view in tensors.items()}
    rewritten = {name: view for name, view in tensors.items() if name not in stored}
    tensors.clear()

    def read(group):
        out = {}
        for name in group:
            if name in mapped:
                out[name] = reader.map(in_files.of_tensor(name))
            elif name in stored:
                out[name] = reader.read(in_files.of_tensor(name), as_loaded(name, dtypes[name]))
            else:
                out[name] = rewritten.pop(name).to(as_loaded(name, dtypes[name]))
        return out

    by_module = {}
    for name in dtypes:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    for layer in layers:
        _assign(model, folder, read(by_module.pop(layer.name, [])))
        if runs_on_int4(layer.name):
            repack_layer(model, layer.name, dtype)
    _assign(model, folder, read([n for group in by_module.values() for n in group]))


def _kept_as_views(model, tensors: dict, device: str, as_loaded) -> set:
    """The input embedding, on the CPU, where it is stored in the load's dtype: it stays in the file, mapped, of which a
    forward makes resident only the rows it looks up (Llama-3-8B's untied one is 1 GB in bf16)."""
    if device != "cpu":
        return set()
    try:
        embedding = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):  # a model class without one (transformers' base raises)
        return set()
    name = next((f"{n}.weight" for n, m in model.named_modules() if m is embedding), None)
    view = tensors.get(name)
    return {name} if view is not None and view.dtype == as_loaded(name, view.dtype) else set()


def _assign(model, folder, tensors: dict) -> None:
    try:
        result = model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[-1].strip()
        raise QuantkitError(f"the tensors of {folder} do not fit the model its config.json describes ({first}): "
                            "the checkpoint is damaged, quantize again") from e
    if result.unexpected_keys:
        raise QuantkitError(f"checkpoint has tensors the model does not: {result.unexpected_keys[:5]}")

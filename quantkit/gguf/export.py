"""model.gguf from a run's part files (or a convert's tensors): llama.cpp's metadata, names and tensor layout.

What llama.cpp's converter writes for the same model, quantkit writes: general.* and the architecture's
hyperparameters (quantkit.gguf.arch), the tokenizer (quantkit.gguf.vocab), and each tensor under
its GGUF name; q_proj / k_proj rows reordered for llama's interleaved rotary; 1-D tensors (norms, biases) as F32,
2-D float tensors in the checkpoint's float type (F16, BF16 or F32), quantized layers as their block type.
Tensors are read and written one at a time.
"""
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.checkpoint import shards
from quantkit.core.errors import QuantkitError
from quantkit.gguf import file
from quantkit.gguf.arch import HPARAMS, arch_of, gguf_name, head_dim, rope_settings, rotary_heads, rotary_rows
from quantkit.gguf.file import BF16, F16, F32, FLOAT32, STRING, UINT32, TensorInfo
from quantkit.gguf.types import TYPES
from quantkit.gguf.vocab import vocab_metadata

FLOAT_TYPES = {"F32": F32, "F16": F16, "BF16": BF16}  # a float tensor's safetensors dtype name -> ggml type
TORCH_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
# llama_ftype: what general.file_type says of a file made with --gguf-type, or whose commonest layer type is this one
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11,
              "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18,
              "IQ2_XXS": 19, "IQ3_XXS": 23, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32}
SMALL_MIX = {"Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S"}  # a k-quant alone is llama.cpp's _S file type


@dataclass
class GGUFSource:
    """What the file says besides the tensors: config.json as written (dict), the tokenizer, the name, and the block
    type of each quantized layer ({module name in the files: "Q4_0"}), and the llama.cpp file type asked for
    (--gguf-type), if any."""
    config: dict
    tokenizer: object
    name: str
    types: dict
    file_type: str | None = None


def check_source(config: dict, tokenizer, names) -> None:
    """Refuse, before any work, a model llama.cpp's layout or tokenizer metadata cannot describe (names: its
    tensors, as transformers saves them)."""
    arch = arch_of(config)
    unplaced = [n for n in names if gguf_name(n) is None]
    if unplaced:
        raise QuantkitError(_no_place(unplaced[0], arch))
    if tokenizer is None:
        raise QuantkitError("--checkpoint-format gguf puts the tokenizer in the file, and this model has none: add "
                            "its tokenizer files to the model folder")
    vocab_metadata(tokenizer, config["vocab_size"])


def _no_place(name: str, arch) -> str:
    return (f"--checkpoint-format gguf: tensor {name} has no place in llama.cpp's {arch.name} layout; write this "
            "model in another format (gptq, awq, compressed-tensors)")


def model_metadata(source: GGUFSource) -> list:
    """[(key, type, value)]: general.*, the architecture's hyperparameters, rotary settings, tokenizer."""
    config, arch = source.config, arch_of(source.config)
    commonest = max(set(source.types.values()), key=list(source.types.values()).count) if source.types else "F16"
    file_type = source.file_type if source.file_type in FILE_TYPES else SMALL_MIX.get(commonest, commonest)  # auto
    meta = [("general.architecture", STRING, arch.name), ("general.name", STRING, source.name),
            ("general.file_type", UINT32, FILE_TYPES.get(file_type, 1)), ("general.quantization_version", UINT32, 2)]
    for key, (fields, kind) in HPARAMS.items():
        value = next((config[f] for f in fields if config.get(f) is not None), None)
        if value is not None:
            meta.append((f"{arch.name}.{key}", UINT32 if kind == "u32" else FLOAT32, value))
    rope = rope_settings(config)
    meta.append((f"{arch.name}.rope.dimension_count", UINT32, head_dim(config)))
    if "rope_theta" in rope:
        meta.append((f"{arch.name}.rope.freq_base", FLOAT32, float(rope["rope_theta"])))
    if rope.get("rope_type") == "linear":
        meta += [(f"{arch.name}.rope.scaling.type", STRING, "linear"),
                 (f"{arch.name}.rope.scaling.factor", FLOAT32, float(rope["factor"]))]
    if config.get("head_dim"):
        meta += [(f"{arch.name}.attention.key_length", UINT32, config["head_dim"]),
                 (f"{arch.name}.attention.value_length", UINT32, config["head_dim"])]
    return meta + vocab_metadata(source.tokenizer, config["vocab_size"])


def _layout(name: str, dtype: str, shape: list, source: GGUFSource) -> TensorInfo:
    """The GGUF entry of a checkpoint tensor (its name as transformers saves it, its stored dtype and shape)."""
    target = gguf_name(name)
    if target is None:
        raise QuantkitError(_no_place(name, arch_of(source.config)))
    module, _, leaf = name.rpartition(".")
    if module in source.types and leaf == "weight":
        kind = TYPES[source.types[module]]
        rows, row_bytes = shape
        cols = row_bytes // kind.block_bytes * kind.block
        return TensorInfo(target, (rows, cols), kind.ggml_type, rows * row_bytes)
    ggml_type = F32 if len(shape) == 1 else FLOAT_TYPES[dtype]
    numel = math.prod(shape)
    return TensorInfo(target, tuple(shape), ggml_type, numel * TORCH_TYPES[ggml_type].itemsize)


def bytes_besides(source: GGUFSource, floats: dict, linears: dict) -> int:
    """model.gguf's bytes besides the quantized linears' blocks, at most: the header (metadata, tokenizer, every
    tensor's entry), the float tensors' data and all alignment padding (after a linear's blocks, whose type is chosen
    later, counted at its most). floats: {name as saved: (dtype name, shape)}, every tensor the file holds besides the
    linears' weights; linears: {module name as saved: (out_features, in_features)}."""
    infos = [_layout(n, *floats[n], source) for n in floats]
    entries = infos + [TensorInfo(gguf_name(f"{m}.weight"), shape, F32, 0) for m, shape in linears.items()]
    head = file.padded(len(file.header(model_metadata(source), entries)))
    return head + sum(file.padded(i.nbytes) for i in infos) + (file.ALIGNMENT - 1) * len(linears)


def _gguf_bytes(name: str, t: torch.Tensor, info: TensorInfo, config: dict) -> torch.Tensor:
    """A checkpoint tensor as the bytes of its GGUF entry: converted (1-D to F32), q/k rows reordered."""
    if info.ggml_type in TORCH_TYPES:
        t = t.to(TORCH_TYPES[info.ggml_type])
    heads = rotary_heads(name, config)
    if heads is not None:
        t = t[rotary_rows(t.shape[0], heads)]
    return t.contiguous().view(-1).view(torch.uint8)


def write_gguf(path: Path, names: list, entries: dict, read, source: GGUFSource) -> None:
    """model.gguf at `path`: `names` (as transformers saves them) in order, entries {name: (dtype name, shape)},
    read(name) -> the tensor as stored."""
    infos = {n: _layout(n, *entries[n], source) for n in names}
    by_target = {info.name: n for n, info in infos.items()}

    def write_tensor(info, out):
        name = by_target[info.name]
        out.write(memoryview(_gguf_bytes(name, read(name), info, source.config).numpy()))

    tmp = path.with_suffix(".partial")
    file.write_gguf(tmp, model_metadata(source), list(infos.values()), write_tensor)
    tmp.replace(path)


def write_from_parts(path: Path, folder: Path, order: list, rename, source: GGUFSource) -> None:
    """model.gguf from a streamed run's part files (quantkit.checkpoint.shards), tensors in checkpoint `order`
    (model names; rename gives the names in the files)."""
    parts = shards.Parts(folder)
    entries = {rename(n): tuple(parts.where[n][2:4]) for n in order}
    by_file = {rename(n): n for n in order}

    def read(name):
        part, offset, dtype, shape, nbytes = parts.where[by_file[name]]
        with open(part, "rb") as f:
            f.seek(offset)
            data = bytearray(f.read(nbytes))
        return torch.frombuffer(data, dtype=shards.DTYPES[dtype]).reshape(shape) if nbytes else torch.empty(shape)

    write_gguf(path, list(entries), entries, read, source)

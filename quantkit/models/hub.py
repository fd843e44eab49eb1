"""Loading the floating-point source model and tokenizer from a hub id or a local folder."""
import os
import sys
from pathlib import Path

import torch

from quantkit.core.errors import QuantkitError, first_line
from quantkit.core.finite import all_finite
from quantkit.models.moe import split_experts

DTYPES = {"auto": "auto", "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name):
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise QuantkitError(f"--dtype {name!r} is not a dtype quantkit computes in: use one of {', '.join(DTYPES)} "
                            "(auto: the dtype the model's config.json declares)")
    return DTYPES[name]


def resolve_device(device: str) -> str:
    """'auto' -> the GPU when there is one, else the CPU. What the code runs on is the CPU and CUDA GPUs (the
    kernels are Triton's for CUDA): any other device, a CUDA device without a GPU or past the last one is a user
    error, named before anything loads."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise QuantkitError(f"--device {device} is not supported: use cpu, cuda, cuda:N (N = 0, 1, ...) or auto")
    if kind == "cuda" and not torch.cuda.is_available():
        raise QuantkitError(f"--device {device} was asked for but no CUDA GPU is visible: use --device cpu or auto")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise QuantkitError(f"--device {device} was asked for but this machine has {torch.cuda.device_count()} "
                            f"GPU(s): use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def model_class(config):
    """The transformers auto class that builds a model of `config`: the image-text-to-text one for a vision-language
    model (its causal-LM class, where it has one, may be the text model alone: Llama 4's drops the vision tower),
    else the causal LM; quantize works on the language model's blocks. A text config no auto class maps, though a
    causal-LM class of transformers is built on it (Emu3's and Mllama's: the auto mapping keys Emu3ForCausalLM by the
    composite Emu3Config, while the class takes Emu3TextConfig and saves it), gets that class (ExactClass)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    # a config registered under a model type other than its own (EvollaConfig under "EvollaModel"): `in` misses it,
    # while the mapping's lookup, which tries every model type of the config, finds its class
    exact = causal_lm_taking(config) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)
    return ExactClass(exact) if exact is not None else AutoModelForCausalLM  # else refused there, in its words


def causal_lm_taking(config):
    """The causal-LM class of transformers (one the auto mapping names) in the config's own model package whose
    config_class is exactly type(config), or None (a config from outside transformers: its auto_map decides)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    package, _, module = type(config).__module__.rpartition(".")
    if not package.startswith("transformers.models.") or not module.startswith("configuration_"):
        return None
    try:
        modeling = importlib.import_module(f"{package}.modeling_{module.removeprefix('configuration_')}")
    except ImportError:
        return None
    found = (getattr(modeling, name, None) for name in dict.fromkeys(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()))
    return next((cls for cls in found if getattr(cls, "config_class", None) is type(config)), None)


class ExactClass:
    """One transformers model class behind an auto class's two verbs (from_config, from_pretrained)."""

    def __init__(self, cls):
        self.cls = cls

    def from_config(self, config, trust_remote_code=False, **kwargs):
        return self.cls._from_config(config, **kwargs)  # what the auto classes' from_config calls

    def from_pretrained(self, *args, **kwargs):
        return self.cls.from_pretrained(*args, **kwargs)


def looks_local(source: str) -> bool:
    """A path-like MODEL argument is never sent to the hub (no surprise downloads)."""
    return os.path.exists(source) or source.startswith((".", "/", "~")) or source.count("/") > 1


def stored_dtype(model, trust_remote_code=False) -> torch.dtype:
    """The dtype the source checkpoint declares (what dtype="auto" gives), fp32 when unknown."""
    from transformers import AutoConfig

    declared = getattr(AutoConfig.from_pretrained(model.name_or_path, trust_remote_code=trust_remote_code), "dtype", None)
    return declared if isinstance(declared, torch.dtype) else torch.float32


def load_fp_model(source: str, dtype="auto", trust_remote_code=False, tokenizer_required=True):
    """(model, tokenizer) in eval mode on CPU, checked complete and finite. Errors name the problem and the fix.

    Weights are read from safetensors only (pickle .bin files can run code when loaded); a model's own Python
    code (auto_map in config.json) runs only with trust_remote_code=True (`--trust-remote-code`)."""
    from safetensors import SafetensorError
    from transformers import AutoConfig

    source = str(source)
    if looks_local(source):
        check_local_folder(source)
        check_safetensors(source)
    remote = {"trust_remote_code": trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(source, **remote)
        dequantize = dequantized_on_load(source, config)
        model, info = model_class(config).from_pretrained(source, config=config, dtype=parse_dtype(dtype),
                                                          output_loading_info=True, use_safetensors=True, **remote,
                                                          **dequantize)
    except SafetensorError as e:
        raise QuantkitError(f"a safetensors file of model '{source}' is truncated or corrupted ({e}): "
                            "download or copy the model again") from e
    except (OSError, ValueError) as e:
        raise load_error(source, e) from e
    _check_complete(source, info)
    model.unloaded_tensors = sorted(info.get("unexpected_keys") or ())  # in the files, not in the model: MTP layers
    check_finite(model, f"model '{source}'")
    split_experts(model)  # fused MoE experts as one linear per expert (quantkit.models.moe)
    model.eval()
    return model, load_tokenizer(source, trust_remote_code, tokenizer_required)


def load_tokenizer(source, trust_remote_code=False, required=True):
    """The model's tokenizer; a folder without usable tokenizer files is a user error that says so, or, when the
    run needs no text (required=False: a data-free method), None with a note."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    except Exception as e:  # the tokenizer libraries' parsers raise anything on a damaged file (KeyError, TypeError)
        if "trust_remote_code" in str(e):
            raise load_error(str(source), e) from e
        if not required:
            print(f"note: no tokenizer could be loaded from '{source}' ({first_line(e)}); this method needs no text, "
                  "and the checkpoint is written without tokenizer files", file=sys.stderr)
            return None
        raise QuantkitError(f"no tokenizer could be loaded from '{source}' ({first_line(e)}): the folder needs its "
                            "model's tokenizer files (tokenizer.json or tokenizer.model, and tokenizer_config.json); "
                            "copy them from where the model came from") from e


def check_local_folder(source: str) -> None:
    path = Path(source).expanduser()
    if not path.is_dir():
        raise QuantkitError(f"model path {source} not found: pass an existing model folder or a hub id like org/name")
    if not (path / "config.json").is_file():
        raise QuantkitError(f"{source} has no config.json: pass a Hugging Face model folder (save_pretrained output)")


def load_error(source: str, e: Exception) -> QuantkitError:
    """What transformers' failure to load `source` means for the user."""
    if "trust_remote_code" in str(e):
        return QuantkitError(f"model '{source}' ships its own Python code (auto_map in its config.json), which "
                             "quantkit runs only when asked: pass --trust-remote-code if you trust that code")
    return QuantkitError(f"could not load model '{source}' ({first_line(e)}): check the id or path, "
                         "or download the model and pass its folder")


def check_safetensors(source: str) -> None:
    """A local folder whose weights are only pickle files is refused (loading them can run arbitrary code)."""
    path = Path(source).expanduser()
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for ext in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in path.glob(ext))
    if pickles:
        raise QuantkitError(f"model {source} has only pickle weights ({pickles[0]}), which can run code when loaded; "
                            "quantkit reads safetensors only: convert it once where you trust the file "
                            "(from_pretrained(...).save_pretrained(folder, safe_serialization=True)) and pass that folder")


def _quantization_config(config) -> dict:
    qc = getattr(config, "quantization_config", None)
    return qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else {})


def is_mxfp4(config) -> bool:
    return _quantization_config(config).get("quant_method") == "mxfp4"


def dequantized_on_load(source, config) -> dict:
    """from_pretrained's extra arguments for a source quantized by its publisher in a format transformers dequantizes
    as it loads: gpt-oss's MXFP4 experts (quant_method mxfp4: 4-bit e2m1 values, a power-of-two scale per 32),
    said on stderr. Any other quantized source is refused."""
    refuse_quantized(source, config)
    if not is_mxfp4(config):
        return {}
    from transformers import Mxfp4Config

    print(f"note: {source} holds MXFP4 experts: transformers dequantizes them as it loads, and they are quantized "
          "as any floating-point weight", file=sys.stderr)
    return {"quantization_config": Mxfp4Config(dequantize=True)}


def fp8_block_size(config):
    """(rows, cols) of the weight blocks of a block-scaled FP8 release (DeepSeek-V3, Qwen3-FP8: quant_method fp8,
    e4m3 weights, a float32 weight_scale_inv per block), which the streamed reader dequantizes; else None."""
    qc = _quantization_config(config)
    block = qc.get("weight_block_size")
    if (qc.get("quant_method") == "fp8" and qc.get("fmt", "e4m3") == "e4m3" and isinstance(block, (list, tuple))
            and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        return tuple(block)
    return None


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """An FP8 weight [out, in] times its per-block scales [ceil(out / rows), ceil(in / cols)], in float32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def refuse_quantized(source, config) -> None:
    """A source its publisher already quantized is refused by name, but gpt-oss's MXFP4 (transformers dequantizes it
    as it loads: dequantized_on_load); block-scaled FP8 is read by the streamed reader before this is asked."""
    qc = getattr(config, "quantization_config", None)
    if qc and not is_mxfp4(config):
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", "?")
        raise QuantkitError(f"model '{source}' is already quantized (quant_method {method}): pass its "
                            "floating-point source to quantize, or `quantkit eval perplexity` to evaluate it")


def _check_complete(source, info: dict) -> None:
    """transformers fills missing tensors with random values: that must never be quantized or evaluated."""
    unexpected = sorted(info.get("unexpected_keys") or ())
    if any(k.endswith((".qweight", ".codes")) for k in unexpected):
        raise QuantkitError(f"model '{source}' holds packed quantized tensors ({unexpected[0]}) but its config.json "
                            "has no quantization_config: restore it (quantize_config.json holds a copy) or quantize "
                            "the floating-point model again")
    missing = sorted(info.get("missing_keys") or ())
    if missing and len(unexpected) >= len(missing) / 2:  # most names differ: the config is another model's
        raise QuantkitError(f"model '{source}': its config.json does not describe its weights ({len(missing)} tensors "
                            f"it declares are not in the files, e.g. {missing[0]}, and the files hold {len(unexpected)} "
                            f"it does not know, e.g. {unexpected[0]}): the config.json belongs to another model or "
                            "architecture; put back the one that came with these weights")
    problems = [(k, "missing") for k in missing]
    problems += [(k[0] if isinstance(k, tuple) else k, "has the wrong shape")
                 for k in sorted(info.get("mismatched_keys") or ())]
    if problems:
        name, what = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise QuantkitError(f"model '{source}' is incomplete: tensor {name} {what}{more}; transformers would fill "
                            "it with random values. Download or copy the model again")


def check_finite(model, what: str) -> None:
    """Every parameter finite: one Inf weight turns every logit of a quantized model into NaN."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not all_finite(p):
            bad = int((~torch.isfinite(p)).sum())
            raise QuantkitError(f"{what}: tensor {name} has {bad} NaN/Inf value(s) of {p.numel()}: the weights are "
                                "damaged (or overflowed when cast to a half type: try --dtype float32); fix the model first")

"""AutoAWQ's GEMM layout (quant_method "awq", version "gemm"), written and read.

Per quantized Linear <name> with K inputs, N outputs, G = K / group_size groups (AutoAWQ
awq/modules/linear/gemm.py, WQLinear_GEMM):
  qweight int32 [K, N/8]   4-bit codes packed along the OUTPUT dim: word c of row k holds, at bits
                           [4i, 4i + 4), the code of output 8c + ORDER[i], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
  qzeros  int32 [G, N/8]   true zero points (no -1), packed the same way
  scales  fp16  [G, N]
  bias    [N]              when the layer has one
w[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = k // group_size. There is no g_idx, no short last group
(WQLinear_GEMM asserts K % group_size == 0 and N % 8 == 0) and only 4 bits ("Only 4-bit are supported").
quantization_config (transformers AwqConfig.to_dict, AutoAWQ AwqConfig.to_transformers_dict):
  {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size", "zero_point": true,
   "modules_to_not_convert": [linears left in float] or null}
A symmetric layer is stored as zeros of 8 (AWQ readers always subtract the stored zero); reading infers sym
back when every zero of a layer is 8, which decodes identically either way.
"""
import torch

from quantkit.checkpoint import repack
from quantkit.checkpoint.codecs import Codec, register_codec
from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.core.result import QuantResult
from quantkit.schemes.grid import Grid, is_int

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # argsort(ORDER): undoes the interleave
BITS = 4
PACK = 32 // BITS  # codes per int32 word, packed along the output dim
TENSORS = ("qweight", "qzeros", "scales")


def pack_outputs(values: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit values -> int32 [R, N/8] in AWQ's interleaved nibble order."""
    rows, n = values.shape
    return bitpack.pack(values.reshape(rows, n // 8, 8)[:, :, list(ORDER)].reshape(rows, n), BITS, dim=1)


def unpack_outputs(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] -> int32 values [R, N], the inverse of pack_outputs."""
    rows, n = words.shape[0], words.shape[1] * 8
    return bitpack.unpack(words, BITS, n, dim=1).reshape(rows, n // 8, 8)[:, :, list(REVERSE)].reshape(rows, n)


def refusal(res: QuantResult) -> str | None:
    """Why the AWQ GEMM layout cannot hold this layer (None when it can)."""
    why = repack.int_refusal(res, "awq")
    if why:
        return why
    n, k = res.codes.shape
    if res.quantizer.bits != BITS:
        return f"AWQ GEMM stores 4-bit codes only, not {res.quantizer.bits}-bit: use --bits 4 or another format"
    if res.group_size == -1 or k % res.group_size:
        return (f"AWQ GEMM needs a group size that divides every layer's inputs ({k} here, group size "
                f"{res.group_size}): quantize again with a --group-size that divides them all, or use "
                "--checkpoint-format compressed-tensors")
    if n % 8:
        return f"AWQ GEMM packs 8 outputs per word, and a layer has {n}: use --checkpoint-format gptq"
    return None


def to_tensors(res: QuantResult, bias_dtype=None) -> dict:
    out = {"qweight": pack_outputs(res.codes.t().contiguous()),
           "qzeros": pack_outputs(res.params["zero"].to(torch.int32).t().contiguous()),
           "scales": res.params["scale"].t().to(torch.float16).contiguous()}
    if res.bias is not None:
        out["bias"] = res.bias.detach().to(bias_dtype or torch.float16).contiguous()
    return out


def from_tensors(tensors: dict, name: str, group_size: int, where: str) -> QuantResult:
    """A layer's AWQ tensors, checked, decoded exactly."""
    qweight = repack.tensor(tensors, name, "qweight", torch.int32, None, where)
    if qweight.dim() != 2:
        raise QuantkitError(f"{where}: {name}.qweight must be 2-D [in, out/8]")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % group_size:
        raise QuantkitError(f"{where}: {name} has {k} inputs, not a multiple of group_size {group_size}")
    groups = k // group_size
    qzeros = repack.tensor(tensors, name, "qzeros", torch.int32, (groups, n // 8), where)
    scales = repack.tensor(tensors, name, "scales", (torch.float16, torch.bfloat16, torch.float32), (groups, n), where)
    zeros = unpack_outputs(qzeros)
    return QuantResult(codes=unpack_outputs(qweight).t().contiguous(),
                       params={"scale": repack.checked_scales(scales, name, where).t().contiguous(),
                               "zero": zeros.t().contiguous()},
                       g_idx=(torch.arange(k) // group_size).to(torch.int32),
                       quantizer=Grid(BITS, bool((zeros == 2 ** (BITS - 1)).all())), group_size=group_size,
                       bias=tensors.get(f"{name}.bias"))


@register_codec
class AWQCodec(Codec):
    """Unrotated 4-bit integer grids <-> AutoAWQ's GEMM layout."""

    quant_method = "awq"
    checkpoint_formats = {"awq": "AutoAWQ GEMM: 4-bit, a group size dividing every layer, no rotation or codebook"}

    @staticmethod
    def accepts(res: QuantResult) -> bool:
        return refusal(res) is None

    refusal = staticmethod(refusal)

    @staticmethod
    def quantization_config(config, results: dict, all_linears, act_order: bool, extra=None, fused=None) -> dict:
        settings = {(r.quantizer.bits, r.group_size) for r in results.values()}
        if len(settings) > 1:
            raise QuantkitError(f"AWQ has one bits/group_size for every layer, and these layers use {sorted(settings)}: "
                                "remove the recipe's bits/group_size overrides or use --checkpoint-format "
                                "compressed-tensors")
        (bits, group_size), = settings
        skipped = [n for n in all_linears if n not in results]
        return {"quant_method": "awq", "version": "gemm", "bits": bits, "group_size": group_size, "zero_point": True,
                "modules_to_not_convert": skipped or None, **(extra or {})}

    @staticmethod
    def layer_tensors(res: QuantResult, config, bias_dtype) -> dict:
        return to_tensors(res, bias_dtype)

    @staticmethod
    def check_config(qc: dict, where: str) -> None:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantkitError(f"{where} is an AWQ checkpoint of version {qc.get('version')!r}: quantkit reads the "
                                "GEMM layout only (version 'gemm'); re-export it with AutoAWQ's GEMM version")
        if qc.get("bits", qc.get("w_bit")) != BITS:
            raise QuantkitError(f"{where} has AWQ bits {qc.get('bits')!r}: the GEMM layout is 4-bit only")
        if qc.get("zero_point", True) is not True:
            raise QuantkitError(f"{where} has zero_point {qc.get('zero_point')!r}: quantkit reads AWQ checkpoints "
                                "with zero points (zero_point: true, what AutoAWQ writes)")
        group_size = qc.get("group_size", qc.get("q_group_size"))
        if not is_int(group_size) or group_size < 1:
            raise QuantkitError(f"{where} has AWQ group_size {group_size!r}: expected a positive whole number")

    @staticmethod
    def read_layers(qc: dict, tensors: dict, where: str) -> list:
        group_size = qc.get("group_size", qc.get("q_group_size"))
        names = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")})
        if not names:
            raise QuantkitError(f"{where} holds no quantized layers (.qweight tensors): the checkpoint is incomplete")
        skipped = qc.get("modules_to_not_convert") or []
        stray = [n for n in names if any(s in n for s in skipped)]  # AutoAWQ matches these as substrings
        if stray:
            raise QuantkitError(f"{where}: {stray[0]} holds packed tensors but modules_to_not_convert lists it")
        layers = [repack.install(tensors, from_tensors(tensors, n, group_size, where), n, TENSORS,
                                 repack.scale_dtype(tensors[f"{n}.scales"])) for n in names]
        repack.note_wide_scales(layers, where)
        return layers

    @staticmethod
    def build_module(layer, qc: dict, dtype):
        return repack.runtime_module(layer, dtype)

    @staticmethod
    def layer_result(tensors: dict, name: str, settings: dict, fmt: str) -> QuantResult:
        return from_tensors(tensors, name, settings["group_size"], "the run being resumed")

    @staticmethod
    def precheck(config, specs: dict, shapes: dict) -> None:
        repack.check_integer_settings(config, "awq")
        kinds = sorted({(s.bits, s.group_size) for s in specs.values() if s is not None})
        if len(kinds) > 1:
            raise QuantkitError(f"--checkpoint-format awq has one bits/group_size for every layer, and the recipe "
                                f"gives {kinds}: drop its bits/group_size overrides, or use --checkpoint-format "
                                "compressed-tensors")
        for name, spec in specs.items():
            k, n = shapes[name]
            if spec is None:
                continue
            if spec.bits != BITS:
                raise QuantkitError(f"--checkpoint-format awq stores 4-bit codes only ({name} has {spec.bits}): "
                                    "use --bits 4, or --checkpoint-format compressed-tensors")
            if n % PACK:  # qweight and qzeros pack 8 outputs per int32 word: no group size changes that
                raise QuantkitError(f"--checkpoint-format awq packs {PACK} outputs per int32 word, and {name} has {n} "
                                    f"outputs, not a multiple of {PACK}, which no --group-size changes: keep such layers "
                                    "in float with a recipe override (skip: true), or use --checkpoint-format gptq "
                                    "or compressed-tensors")
            if spec.group_size == -1 or k % spec.group_size:
                fits = next((g for g in (128, 64, 32, 16) if k % g == 0), None)
                raise QuantkitError(f"--checkpoint-format awq needs a group size dividing every layer's inputs "
                                    f"({name}: {k} inputs, group size {spec.group_size}): pick a --group-size that "
                                    f"divides them{f' (such as {fits})' if fits else ''}, or use --checkpoint-format "
                                    "gptq or compressed-tensors")

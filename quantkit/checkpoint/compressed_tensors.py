"""compressed-tensors "pack-quantized" (what llm-compressor writes, quant_method "compressed-tensors").

Per quantized Linear <name> with K inputs, N outputs, b bits, p = 32 // b codes per int32 word, G groups
(compressed_tensors/compressors/quantized_compressors/pack_quantized.py, PackedQuantizationCompressor):
  weight_packed     int32 [N, ceil(K / p)]   signed codes + 2^(b-1) (= quantkit's unsigned code q), packed
                                             along the input dim, code i of a word at bits [b*i, b*i + b);
                                             a word holds p whole codes (3-bit: 10 codes, 2 bits unused)
  weight_scale      fp16  [N, G]             G = ceil(K / group_size) ("group"), 1 ("channel")
  weight_zero_point int32 [ceil(N / p), G]   asymmetric only: zero + 2^(b-1) (= quantkit's zero), packed
                                             the same way along the OUTPUT dim; symmetric layers have none
  weight_shape      int64 [2]                [N, K]
  bias              [N]                      when the layer has one
w[n, k] = weight_scale[n, g] * (q[n, k] - z[n, g]), g = k // group_size, z = 2^(b-1) when symmetric.
An older layout with an unpacked int8 [N, G] weight_zero_point (the signed zero) is read too.
"""
import re

import torch

from quantkit.checkpoint import repack
from quantkit.checkpoint.codecs import Codec, register_codec
from quantkit.core.errors import QuantkitError
from quantkit.core.groups import n_groups
from quantkit.core.result import QuantResult
from quantkit.schemes.grid import Grid, is_int

FORMAT = "pack-quantized"
BITS = (2, 3, 4, 8)
TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values along `dim` -> int32 words of 32 // bits whole codes each (pack_to_int32's layout)."""
    per = 32 // bits
    v = values.movedim(dim, -1).to(torch.int64)
    pad = -v.shape[-1] % per
    v = torch.nn.functional.pad(v, (0, pad)).reshape(*v.shape[:-1], -1, per)
    words = (v << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def unpack_words(words: torch.Tensor, bits: int, length: int, dim: int) -> torch.Tensor:
    """Inverse of pack_words: int32 [.., W, ..] -> int32 values [.., length, ..] along `dim`."""
    per = 32 // bits
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    v = (w.unsqueeze(-1) >> (torch.arange(per) * bits)) & (2**bits - 1)
    return v.reshape(*w.shape[:-1], -1)[..., :length].to(torch.int32).movedim(-1, dim).contiguous()


def refusal(res: QuantResult) -> str | None:
    why = repack.int_refusal(res, "compressed-tensors")
    if why is None and res.quantizer.bits not in BITS:
        why = f"pack-quantized stores {BITS} bits, not {res.quantizer.bits}"
    return why


def weights_args(bits: int, group_size: int, sym: bool) -> dict:
    """A QuantizationArgs dict (compressed_tensors/quantization/quant_args.py), every field written."""
    return {"num_bits": bits, "type": "int", "symmetric": sym, "group_size": None if group_size == -1 else group_size,
            "strategy": "channel" if group_size == -1 else "group", "block_structure": None, "dynamic": False,
            "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def quantization_config(results: dict, all_linears, extra=None) -> dict:
    """One config group per distinct (bits, group_size, sym), its targets the layers' exact names (a "Linear"
    target would also claim lm_head and any other linear quantkit leaves in float)."""
    groups = {}
    for name in all_linears:
        if name in results:
            r = results[name]
            groups.setdefault((r.quantizer.bits, r.group_size, r.quantizer.sym), []).append(name)
    config_groups = {f"group_{i}": {"targets": names, "weights": weights_args(*key), "input_activations": None,
                                    "output_activations": None, "format": FORMAT}
                     for i, (key, names) in enumerate(groups.items())}
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": [n for n in all_linears if n not in results],
            "kv_cache_scheme": None, "global_compression_ratio": None, **(extra or {})}


def to_tensors(res: QuantResult, bias_dtype=None) -> dict:
    bits, (n, k) = res.quantizer.bits, res.codes.shape
    out = {"weight_packed": pack_words(res.codes, bits, dim=1),
           "weight_scale": res.params["scale"].to(torch.float16).contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not res.quantizer.sym:
        out["weight_zero_point"] = pack_words(res.params["zero"].to(torch.int32), bits, dim=0)
    if res.bias is not None:
        out["bias"] = res.bias.detach().to(bias_dtype or torch.float16).contiguous()
    return out


def _zeros(tensors, name, args, n, groups, where) -> torch.Tensor:
    bits = args["num_bits"]
    if args.get("symmetric", True):  # QuantizationArgs defaults to symmetric
        if f"{name}.weight_zero_point" in tensors:
            raise QuantkitError(f"{where}: {name} is declared symmetric but stores weight_zero_point")
        return torch.full((n, groups), 2 ** (bits - 1), dtype=torch.int32)
    zp = tensors.get(f"{name}.weight_zero_point")
    if zp is not None and zp.dtype == torch.int8 and tuple(zp.shape) == (n, groups):  # the unpacked layout
        return zp.to(torch.int32) + 2 ** (bits - 1)
    zp = repack.tensor(tensors, name, "weight_zero_point", torch.int32, (-(-n // (32 // bits)), groups), where)
    return unpack_words(zp, bits, n, dim=0)


def from_tensors(tensors: dict, name: str, args: dict, where: str) -> QuantResult:
    """A layer's pack-quantized tensors, checked, decoded exactly."""
    shape = repack.tensor(tensors, name, "weight_shape", (torch.int64, torch.int32), (2,), where)
    n, k = (int(x) for x in shape)
    bits = args["num_bits"]
    group_size = args["group_size"] if args["strategy"] == "group" else -1
    groups = n_groups(k, group_size)
    packed = repack.tensor(tensors, name, "weight_packed", torch.int32, (n, -(-k // (32 // bits))), where)
    scale = repack.tensor(tensors, name, "weight_scale", SCALE_DTYPES, (n, groups), where)
    g_idx = tensors.get(f"{name}.weight_g_idx")
    if g_idx is None:
        g_idx = torch.zeros(k, dtype=torch.int32) if group_size == -1 else torch.arange(k) // group_size
    elif tuple(g_idx.shape) != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise QuantkitError(f"{where}: {name}.weight_g_idx must hold {k} groups in 0..{groups - 1}")
    return QuantResult(codes=unpack_words(packed, bits, k, dim=1),
                       params={"scale": repack.fp16_scales(scale, name, where).float(),
                               "zero": _zeros(tensors, name, args, n, groups, where)},
                       g_idx=g_idx.to(torch.int32), quantizer=Grid(bits, args.get("symmetric", True)),
                       group_size=group_size, bias=tensors.get(f"{name}.bias"))


def _matches(target: str, name: str) -> bool:
    """A target as compressed-tensors reads it: "re:<regex>" (re.match), a module name, or a class name
    ("Linear"; every layer holding weight_packed is a linear)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (name, "Linear")


def scheme_for(qc: dict, name: str, where: str) -> dict:
    """The weights args of the config group that targets `name` (a name or regex beats the class "Linear")."""
    if any(_matches(t, name) and t != "Linear" for t in qc.get("ignore") or []):
        raise QuantkitError(f"{where}: {name} holds packed tensors but 'ignore' lists it")
    found = [(t == "Linear", g["weights"]) for g in qc["config_groups"].values() for t in g["targets"]
             if _matches(t, name)]
    if not found:
        raise QuantkitError(f"{where}: {name} holds packed tensors but no config group targets it")
    return min(found, key=lambda f: f[0])[1]


def check_group(key: str, group, where: str) -> None:
    """The fields of one config group quantkit reads; anything it would have to guess is refused by name."""
    where = f"{where} config_groups.{key}"
    w = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(w, dict) or not isinstance(group.get("targets"), list):
        raise QuantkitError(f"{where} needs 'targets' (a list) and 'weights' (an object)")
    if group.get("input_activations") or group.get("output_activations"):
        raise QuantkitError(f"{where} quantizes activations too: quantkit reads weight-only (WnA16) checkpoints")
    if group.get("format") not in (None, FORMAT):
        raise QuantkitError(f"{where} has format {group['format']!r}: quantkit reads {FORMAT!r} only")
    if w.get("type", "int") != "int" or w.get("num_bits") not in BITS:
        raise QuantkitError(f"{where} has {w.get('type')} weights of {w.get('num_bits')!r} bits: quantkit reads "
                            f"int weights of {', '.join(map(str, BITS))} bits")
    if w.get("strategy") not in ("group", "channel") or w.get("dynamic"):
        raise QuantkitError(f"{where} has strategy {w.get('strategy')!r}"
                            f"{' (dynamic)' if w.get('dynamic') else ''}: quantkit reads static 'group' and "
                            "'channel' weight scales")
    if w["strategy"] == "group" and not (is_int(w.get("group_size")) and w["group_size"] > 0):
        raise QuantkitError(f"{where} has group_size {w.get('group_size')!r}: expected a positive whole number")
    if not isinstance(w.get("symmetric", True), bool):
        raise QuantkitError(f"{where} symmetric must be true or false")


@register_codec
class CompressedTensorsCodec(Codec):
    """Unrotated integer grids <-> compressed-tensors pack-quantized."""

    quant_method = "compressed-tensors"
    checkpoint_formats = {"compressed-tensors": "llm-compressor's pack-quantized; no rotation or codebook"}
    refusal = staticmethod(refusal)

    @staticmethod
    def accepts(res: QuantResult) -> bool:
        return refusal(res) is None

    @staticmethod
    def quantization_config(config, results: dict, all_linears, act_order: bool, extra=None, fused=None) -> dict:
        return quantization_config(results, all_linears, extra)

    @staticmethod
    def layer_tensors(res: QuantResult, config, bias_dtype) -> dict:
        return to_tensors(res, bias_dtype)

    @staticmethod
    def check_config(qc: dict, where: str) -> None:
        if qc.get("format") != FORMAT:
            raise QuantkitError(f"{where} is a compressed-tensors checkpoint of format {qc.get('format')!r}: quantkit "
                                f"reads {FORMAT!r} only")
        if qc.get("kv_cache_scheme") or (qc.get("sparsity_config") or {}).get("format", "dense") != "dense":
            raise QuantkitError(f"{where} has a kv_cache_scheme or a sparsity_config: quantkit reads weight-only "
                                "pack-quantized checkpoints without them")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise QuantkitError(f"{where} quantization_config needs 'config_groups'")
        for key, group in groups.items():
            check_group(key, group, where)

    @staticmethod
    def read_layers(qc: dict, tensors: dict, where: str) -> list:
        names = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")})
        if not names:
            raise QuantkitError(f"{where} holds no quantized layers (.weight_packed tensors): it is incomplete")
        results = [(n, from_tensors(tensors, n, scheme_for(qc, n, where), where)) for n in names]
        return [repack.install(tensors, res, n, TENSORS) for n, res in results]

    @staticmethod
    def build_module(layer, qc: dict, dtype):
        return repack.runtime_module(layer, dtype)

    @staticmethod
    def layer_result(tensors: dict, name: str, settings: dict, fmt: str) -> QuantResult:
        args = weights_args(settings["bits"], settings["group_size"], settings["sym"])
        return from_tensors(tensors, name, args, "the run being resumed")

    @staticmethod
    def precheck(config, specs: dict, shapes: dict) -> None:
        repack.check_integer_settings(config, "compressed-tensors")

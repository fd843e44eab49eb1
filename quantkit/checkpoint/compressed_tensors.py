"""compressed-tensors "pack-quantized" (what llm-compressor writes, quant_method "compressed-tensors").

Per quantized Linear <name> with K inputs, N outputs, b bits, G groups
(compressed_tensors/compressors/pack_quantized/base.py and helpers.py pack_to_int32, version 0.18 to 0.20):
  weight_packed     int32 [N, ceil(K*b/32)]  signed codes + 2^(b-1) (= quantkit's unsigned code q), packed
                                             along the input dim as one dense bit stream: code i at stream bits
                                             [b*i, b*i + b), word j = bits [32j, 32j + 32) (a 3-bit code may
                                             straddle two words)
  weight_scale      fp16  [N, G]             G = ceil(K / group_size) ("group"), 1 ("channel"); bf16 and fp32
                                             are read too
  weight_zero_point int32 [ceil(N*b/32), G]  asymmetric only: zero + 2^(b-1) (= quantkit's zero), packed
                                             the same way along the OUTPUT dim; symmetric layers have none
  weight_shape      int64 [2]                [N, K]
  bias              [N]                      when the layer has one
w[n, k] = weight_scale[n, g] * (q[n, k] - z[n, g]), g = k // group_size, z = 2^(b-1) when symmetric.
Read too: compressed-tensors <= 0.17's packing (32 // b whole codes per word: at 3 bits 10 codes and 2 unused bits,
ceil(K / 10) words; at 2, 4, 8 bits the same words as the dense stream), and an unpacked int8 [N, G]
weight_zero_point (the signed zero).
"""
import re

import torch

from quantkit.checkpoint import compat, repack
from quantkit.checkpoint.codecs import Codec, register_codec
from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.core.groups import n_groups
from quantkit.core.options import is_int
from quantkit.core.result import QuantResult
from quantkit.schemes.grid import Grid

FORMAT = "pack-quantized"
BITS = (2, 3, 4, 8)
TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values along `dim` -> int32 words holding them as one dense bit stream: value i at stream bits
    [b*i, b*i + b), word j the stream's bits [32j, 32j + 32), a value split across two words where it must;
    ceil(L * b / 32) words (compressed-tensors >= 0.18 pack_to_int32; at 2, 4 and 8 bits the same words as
    before, since no value straddles a word)."""
    v = values.movedim(dim, -1).to(torch.int64)
    start = torch.arange(v.shape[-1]) * bits
    word, offset = start // 32, start % 32
    n_words = -(-v.shape[-1] * bits // 32)
    words = torch.zeros(*v.shape[:-1], n_words + 1, dtype=torch.int64)
    words.index_add_(-1, word, (v << offset) & 0xFFFFFFFF)  # disjoint bit ranges: adding is or-ing
    spill = offset + bits > 32
    words.index_add_(-1, word[spill] + 1, v[..., spill] >> (32 - offset[spill]))
    words = words[..., :n_words]
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def unpack_words(words: torch.Tensor, bits: int, length: int, dim: int) -> torch.Tensor:
    """Inverse of pack_words: int32 [.., ceil(length * bits / 32), ..] -> int32 values [.., length, ..]."""
    w = torch.nn.functional.pad(words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF, (0, 1))
    start = torch.arange(length) * bits
    word, offset = start // 32, start % 32
    v = (w[..., word] >> offset) | (w[..., word + 1] << (32 - offset))
    return (v & (2**bits - 1)).to(torch.int32).movedim(-1, dim).contiguous()


def unpack_whole_codes(words: torch.Tensor, bits: int, length: int, dim: int) -> torch.Tensor:
    """compressed-tensors <= 0.17's packing, read: 32 // bits whole codes per word (3-bit: 10, 2 bits unused)."""
    per = 32 // bits
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    v = (w.unsqueeze(-1) >> (torch.arange(per) * bits)) & (2**bits - 1)
    return v.reshape(*w.shape[:-1], -1)[..., :length].to(torch.int32).movedim(-1, dim).contiguous()


def dense_words(length: int, bits: int) -> int:
    return -(-length * bits // 32)


def whole_code_words(length: int, bits: int) -> int:
    return -(-length // (32 // bits))


def unpack_any(words: torch.Tensor, bits: int, length: int, dim: int, version, what: str, where: str):
    """Values from either packing: told apart by the word count, and where both counts agree (a 3-bit run of up to
    about 150 values) by the config's compressed-tensors `version` (before 0.18: whole codes)."""
    count = words.shape[dim]
    dense, whole = dense_words(length, bits), whole_code_words(length, bits)
    if count not in (dense, whole):
        raise QuantkitError(f"{where}: {what} has {count} int32 words along dim {dim}, but {length} values of {bits} "
                            f"bits take {dense} (compressed-tensors >= 0.18) or {whole} (<= 0.17): the checkpoint is "
                            "damaged")
    if count == dense and (dense != whole or not _before_dense(version)):
        return unpack_words(words, bits, length, dim)
    return unpack_whole_codes(words, bits, length, dim)


def _before_dense(version) -> bool:
    """Whether the config's compressed-tensors version predates the dense packing (0.18.0); unknown: it does not."""
    m = re.match(r"(\d+)\.(\d+)", str(version or ""))
    return m is not None and (int(m[1]), int(m[2])) < (0, 18)


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


def _zeros(tensors, name, args, n, groups, version, where) -> torch.Tensor:
    bits = args["num_bits"]
    if args.get("symmetric", True):  # QuantizationArgs defaults to symmetric
        if f"{name}.weight_zero_point" in tensors:
            raise QuantkitError(f"{where}: {name} is declared symmetric but stores weight_zero_point")
        return torch.full((n, groups), 2 ** (bits - 1), dtype=torch.int32)
    zp = tensors.get(f"{name}.weight_zero_point")
    if zp is not None and zp.dtype == torch.int8 and tuple(zp.shape) == (n, groups):  # the unpacked layout
        return zp.to(torch.int32) + 2 ** (bits - 1)
    return _unpacked(tensors, name, "weight_zero_point", bits, (n, groups), 0, version, where)


def _unpacked(tensors, name, suffix, bits, shape, dim, version, where) -> torch.Tensor:
    """The values [shape] packed along `dim` in tensor name.suffix (either packing, unpack_any), checked."""
    t = repack.tensor(tensors, name, suffix, torch.int32, None, where)
    if t.dim() != 2 or t.shape[1 - dim] != shape[1 - dim]:
        raise QuantkitError(f"{where}: {name}.{suffix} is {tuple(t.shape)}, but its layer needs {shape[1 - dim]} along "
                            f"dim {1 - dim}: the tensors and the config disagree")
    return unpack_any(t, bits, shape[dim], dim, version, f"{name}.{suffix}", where)


def from_tensors(tensors: dict, name: str, args: dict, where: str, version=None) -> QuantResult:
    """A layer's pack-quantized tensors, checked, decoded exactly; version: the config's compressed-tensors
    version (which packing a 3-bit tensor uses when its size cannot tell)."""
    shape = repack.tensor(tensors, name, "weight_shape", (torch.int64, torch.int32), (2,), where)
    n, k = (int(x) for x in shape)
    bits = args["num_bits"]
    group_size = args["group_size"] if args["strategy"] == "group" else -1
    groups = n_groups(k, group_size)
    scale = repack.tensor(tensors, name, "weight_scale", SCALE_DTYPES, (n, groups), where)
    g_idx = tensors.get(f"{name}.weight_g_idx")
    if g_idx is None:
        g_idx = torch.zeros(k, dtype=torch.int32) if group_size == -1 else torch.arange(k) // group_size
    elif tuple(g_idx.shape) != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise QuantkitError(f"{where}: {name}.weight_g_idx must hold {k} groups in 0..{groups - 1}")
    return QuantResult(codes=_unpacked(tensors, name, "weight_packed", bits, (n, k), 1, version, where),
                       params={"scale": repack.checked_scales(scale, name, where),
                               "zero": _zeros(tensors, name, args, n, groups, version, where)},
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
        results = [(n, from_tensors(tensors, n, scheme_for(qc, n, where), where, qc.get("version"))) for n in names]
        layers = [repack.install(tensors, res, n, TENSORS, repack.scale_dtype(tensors[f"{n}.weight_scale"]))
                  for n, res in results]
        repack.note_wide_scales(layers, where)
        return layers

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

    @staticmethod
    def layer_bits(bits: int, group_size: int, sym: bool, in_features: int, out_features: int) -> int:
        """weight_packed (int32, dense), weight_scale (float16), weight_zero_point (asymmetric only: int32 packed
        along the outputs) and weight_shape (two int64)."""
        groups = n_groups(in_features, group_size)
        zeros = 0 if sym else bitpack.packed_len(out_features, bits) * groups
        return 32 * (out_features * bitpack.packed_len(in_features, bits) + zeros) + 16 * out_features * groups + 128

    @staticmethod
    def compat_problems(config, specs: dict, shapes: dict, fused: dict, fused_experts=frozenset()) -> list:
        return compat.ct_problems(config, specs, shapes, fused)

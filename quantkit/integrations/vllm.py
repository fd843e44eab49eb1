"""quant_method "quantkit" as a vLLM out-of-tree quantization method: with quantkit installed next to vLLM,

    vllm.LLM(model=folder)                       # config.json names quant_method "quantkit"
    vllm serve folder --quantization quantkit

serve a quantkit-format folder (quantkit.checkpoint.quantkit_format: codebook, rotated, integer or mixed layers)
with quantkit's own runtime modules (DecodedLinear, QuantLinear): Triton kernels on CUDA, the torch path on the CPU.

How it plugs in (vLLM 0.32/0.33): the entry point `quantkit` of group `vllm.general_plugins` (pyproject.toml) makes
every vLLM process call `register()`, which puts QuantkitConfig in vLLM's quantization registry. For each linear
vLLM builds, `get_quant_method` returns QuantkitLinearMethod when the checkpoint lists it (or, for the layers vLLM
fuses, qkv_proj / gate_up_proj, all of its members: the model's packed_modules_mapping), else
UnquantizedLinearMethod. The method's parameters carry the checkpoint's tensor names; a fused layer's tensors are
its members' concatenated along the output dim, which vLLM's own (v1) weight loaders place (`output_dim`), except
for the few tensors placed here: qzeros (packed along the outputs, where a member's words need not end on a word
boundary), g_idx and rot_signs (one per member). After loading, the tensors go into one quantkit module, or, when the
members' rotation signs or g_idx differ (quantkit draws every layer its own signs, so every rotated fused layer
does), into one module per member whose outputs are concatenated. Under vLLM's torch.compile (and so in its CUDA
graphs) a layer's forward is one opaque custom op, quantkit_vllm::linear.

Refused with the reason: tensor parallelism (tensor_parallel_size must be 1), fused members with different settings
(quantizer, bits, group size, rotation block), a fused layer with only some members quantized, and quantized layers
that vLLM does not build as linears (experts of MoE layers, lm_head or the embedding): quantkit.load_quantized loads
all of those.
"""
import dataclasses
from fractions import Fraction

import torch
from torch import nn
from vllm.config import get_current_vllm_config_or_none
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from quantkit.checkpoint import quantkit_format
from quantkit.checkpoint.quantkit_format import QuantkitCodec, quantizer_of
from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.core.groups import n_groups
from quantkit.nn.decoded_linear import DecodedLinear
from quantkit.schemes.base import param_dtype

METHOD = "quantkit"
QKV_SHARDS = ("q", "k", "v")  # QKVParallelLinear's shard ids, in member order
LOAD_WITH = "load the folder with quantkit.load_quantized instead"


class _Runtime:
    """One layer's quantkit module(s): one for the whole layer, or one per fused member (outputs concatenated)."""

    def __init__(self, modules, out_features: int):
        self.modules, self.out_features = list(modules), out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.modules) == 1:
            return self.modules[0](x)
        return torch.cat([m(x) for m in self.modules], dim=-1)


# What a compiled graph (vLLM's torch.compile, CUDA graphs) calls for a quantkit layer: one opaque op, which finds the
# layer by name in the running engine's forward context, as vLLM's own attention and LoRA ops find theirs. The name is
# the layer's prefix, the same in every process and every run, so vLLM's cached compiled graphs stay valid; eager
# forwards call the layer's modules directly.
@torch.library.custom_op("quantkit_vllm::linear", mutates_args=())
def _linear(x: torch.Tensor, layer_name: str, out_features: int) -> torch.Tensor:
    """x @ Ŵᵀ (+ the layer's bias, when its modules hold it) of the quantkit layer `layer_name`."""
    layer = get_forward_context().no_compile_layers[layer_name]
    return layer.__dict__["_quantkit_runtime"](x)


@_linear.register_fake
def _(x: torch.Tensor, layer_name: str, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _shape_settings(settings: dict) -> dict:
    """What must agree between the members of one fused layer: everything but the seed of the rotation signs."""
    rotation = settings.get("rotation")
    if rotation is not None:
        rotation = {k: v for k, v in rotation.items() if k != "seed"}
    return {**settings, "rotation": rotation}


class QuantkitConfig(QuantizationConfig):
    """A folder's quantization_config (format_version, layers {name: settings}, the run's options)."""

    def __init__(self, qc: dict):
        super().__init__()
        self.qc = qc
        self.layers = dict(qc["layers"])

    def __repr__(self) -> str:
        return f"QuantkitConfig({len(self.layers)} quantized layers)"

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70  # Triton's floor; bfloat16 activations need 80 (vLLM checks the dtype itself)

    @staticmethod
    def get_config_filenames() -> list:
        return []  # config.json's quantization_config is the one read

    @classmethod
    def from_config(cls, config: dict) -> "QuantkitConfig":
        if config.get("quant_method", METHOD) != METHOD:
            raise QuantkitError(f"quantization_config names quant_method {config.get('quant_method')!r}, not "
                                f"{METHOD!r}: serve it with vLLM's own method of that name")
        QuantkitCodec.check_config(config, "quantization_config")
        return cls(config)

    @staticmethod
    def get_checkpoint_weight_mapper():
        """vLLM's default drops every `.g_idx` (its kernels have no act-order); quantkit layers need theirs."""
        from vllm.model_executor.models.utils import WeightsMapper

        return WeightsMapper()

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """The layer names as the vLLM model names its modules (e.g. a multimodal model's language_model prefix)."""
        self.layers = hf_to_vllm_mapper.apply_dict(self.layers)

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            return self._linear_method(prefix)
        held = sorted(n for n in self.layers if n == prefix or n.startswith(prefix + "."))
        if held and prefix:
            raise QuantkitError(f"quantized layer {held[0]} is part of {prefix}, which vLLM builds as a "
                                f"{type(layer).__name__}, not as linears: vLLM cannot serve it with the quantkit "
                                f"plugin; {LOAD_WITH}")
        return None

    def _linear_method(self, prefix: str):
        if prefix in self.layers:
            return QuantkitLinearMethod(self, prefix, [prefix], self.layers[prefix])
        parent, _, leaf = prefix.rpartition(".")
        members = [f"{parent}.{m}" if parent else m for m in self.packed_modules_mapping.get(leaf, ())]
        listed = [m for m in members if m in self.layers]
        if not listed:
            return UnquantizedLinearMethod()
        if len(listed) != len(members):
            plain = [m for m in members if m not in self.layers]
            raise QuantkitError(f"vLLM fuses {', '.join(members)} into one layer {prefix}, but the checkpoint "
                                f"quantizes {', '.join(listed)} and leaves {', '.join(plain)} in float: vLLM cannot "
                                f"serve that mix; {LOAD_WITH}")
        first = _shape_settings(self.layers[members[0]])
        for m in members[1:]:
            other = _shape_settings(self.layers[m])
            if other != first:
                differ = "; ".join(f"{key} {first.get(key)!r} and {other.get(key)!r}"
                                   for key in sorted({*first, *other}) if first.get(key) != other.get(key))
                raise QuantkitError(f"vLLM fuses {', '.join(members)} into one layer {prefix}, which needs one "
                                    f"setting, but {members[0]} and {m} differ ({differ}); {LOAD_WITH}")
        return QuantkitLinearMethod(self, prefix, members, self.layers[members[0]])


class QuantkitLinearMethod(LinearMethodBase):
    """A linear whose members (one, or the checkpoint layers vLLM fused into it) are quantkit layers of one setting."""

    def __init__(self, config: QuantkitConfig, prefix: str, members: list, settings: dict):
        self.config, self.prefix, self.members = config, prefix, members
        self.settings = {"rotation": None, **settings}
        self.quantizer = quantizer_of(self.settings)

    # --- parameters: the checkpoint's names and shapes -------------------------------------------------------------
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list,
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if k != input_size or n != output_size:
            raise QuantkitError(f"{self.prefix}: vLLM splits it for tensor parallelism ({input_size}->{output_size} "
                                f"becomes {k}->{n} per rank); the quantkit plugin serves tensor_parallel_size=1 "
                                f"only (pipeline parallelism works): set tensor_parallel_size=1")
        if len(self.members) > 1 and len(output_partition_sizes) != len(self.members):
            raise QuantkitError(f"{self.prefix}: vLLM fuses {len(output_partition_sizes)} outputs but its packed "
                                f"modules mapping names {len(self.members)} members ({', '.join(self.members)})")
        weight_loader = extra_weight_attrs.pop("weight_loader")
        s, q = self.settings, self.quantizer
        groups = n_groups(k, s["group_size"])
        bits = s["bits"] if s["quantizer"] == "int" else q.code_bits
        packed = {"packed_dim": 0, "packed_factor": 32 // bits if 32 % bits == 0 else Fraction(32, bits)}
        if s["quantizer"] == "int":
            placed = {"qweight": ((bitpack.packed_len(k, bits), n), torch.int32, packed),
                      "scales": ((groups, n), torch.float16, {})}
            own = {"qzeros": ((groups, bitpack.packed_len(n, bits)), torch.int32)}
        else:
            placed = {"codes": ((bitpack.packed_len(k, bits), n), torch.int32, packed),
                      **{key: ((groups, n), param_dtype(q, key), {}) for key in q.param_bits}}
            own = {}
        own["g_idx"] = ((k,), torch.int32)
        if s["rotation"] is not None:
            own["rot_signs"] = ((k,), torch.int8)
        for name, (shape, dtype, attrs) in placed.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            # vLLM's (v1) loaders: each member's [.., N_i] tensor goes to its slice of the output dim
            set_weight_attrs(param, {"input_dim": 0, "output_dim": 1, **attrs, "weight_loader": weight_loader,
                                     **extra_weight_attrs})
        for name, (shape, dtype) in own.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {"weight_loader": self._member_loader(layer, name), **extra_weight_attrs})
        layer.__dict__.update(_quantkit=dict(k=k, n=n, sizes=list(output_partition_sizes), dtype=params_dtype,
                                             placed=list(placed), own=list(own), shards={}),
                              _quantkit_name=f"{self.prefix}.quantkit")
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None:  # where the compiled graph's op finds the layer (forward_context.no_compile_layers)
            layers = vllm_config.compilation_config.static_forward_context
            if layer.__dict__["_quantkit_name"] in layers:
                raise ValueError(f"Duplicate layer name: {layer.__dict__['_quantkit_name']}")
            layers[layer.__dict__["_quantkit_name"]] = layer

    def _member_loader(self, layer: nn.Module, name: str):
        """Loads qzeros, g_idx and rot_signs: a member's copy is kept whole until all are in (process_weights_...)."""
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
            if loaded_shard_id is None:  # the whole layer's tensor (an unfused layer, or members fused on disk)
                if tuple(loaded_weight.shape) != tuple(param.shape):
                    raise QuantkitError(f"{self.prefix}.{name} in the checkpoint is {tuple(loaded_weight.shape)}, the "
                                        f"layer's settings make it {tuple(param.shape)}: the tensors and the config "
                                        "disagree")
                param.data.copy_(loaded_weight)
                return
            index = self._member_index(layer, loaded_shard_id)
            layer.__dict__["_quantkit"]["shards"].setdefault(name, {})[index] = loaded_weight.to(param.device,
                                                                                             copy=True)
        return load

    def _member_index(self, layer: nn.Module, shard_id) -> int:
        sizes = layer.__dict__["_quantkit"]["sizes"]
        index = QKV_SHARDS.index(shard_id) if shard_id in QKV_SHARDS else shard_id
        if not isinstance(index, int) or not 0 <= index < len(sizes):
            raise QuantkitError(f"{self.prefix}: vLLM loads its shard {shard_id!r}, which the quantkit plugin does not "
                                f"place (members: {', '.join(self.members)}); {LOAD_WITH}")
        return index

    # --- after loading: quantkit modules over the loaded tensors ----------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        state = layer.__dict__.pop("_quantkit")
        tensors = {name: getattr(layer, name).data for name in state["placed"] + state["own"]}
        shards = state["shards"]
        # The modules add the bias as load_quantized's do (inside their float32 accumulation on the CPU), where vLLM
        # passes it to apply (not for skip_bias_add layers, whose caller adds it)
        bias = getattr(layer, "bias", None)
        bias = bias.data if bias is not None and not getattr(layer, "skip_bias_add", False) else None
        if shards:  # members loaded one by one: their own tensors are in `shards`
            missing = [f"{self.members[i]}.{name}" for name in state["own"] for i in range(len(self.members))
                       if i not in shards.get(name, {})]
            if missing:
                raise QuantkitError(f"{self.prefix}: the checkpoint lacks {', '.join(missing)}: it is incomplete, "
                                    "quantize again")
            alike = all(torch.equal(shards[name][i], shards[name][0]) for name in ("g_idx", "rot_signs")
                        if name in shards for i in range(len(self.members)))
            if alike:  # one module for the fused layer
                for name in ("g_idx", "rot_signs"):
                    if name in shards:
                        tensors[name] = shards[name][0]
                if "qzeros" in shards:
                    zeros = [bitpack.unpack(shards["qzeros"][i], self.settings["bits"], size, dim=1)
                             for i, size in enumerate(state["sizes"])]
                    tensors["qzeros"] = bitpack.pack(torch.cat(zeros, dim=1), self.settings["bits"], dim=1)
                modules = [self._module(self.prefix, tensors, bias, state["dtype"])]
            else:  # each member its own rotation signs / g_idx: one module each
                starts = [sum(state["sizes"][:i]) for i in range(len(self.members))]
                modules = [self._module(m, t, None if bias is None else bias[a:a + n], state["dtype"]) for m, t, a, n
                           in zip(self.members, self._split(tensors, shards, state["sizes"]), starts, state["sizes"])]
        else:
            modules = [self._module(self.prefix, tensors, bias, state["dtype"])]
        for name in state["placed"] + state["own"]:
            delattr(layer, name)  # the modules hold them now
        layer.quantkit_modules = nn.ModuleList(modules)
        with torch.no_grad():  # one call now: kernels compiled, per-layer checks cached, before any CUDA graph capture
            for module in modules:
                module(torch.zeros(1, state["k"], dtype=state["dtype"], device=module.g_idx.device))
        layer.__dict__.update(_quantkit_runtime=_Runtime(modules, state["n"]), _quantkit_bias_inside=bias is not None)

    def _split(self, tensors: dict, shards: dict, sizes: list) -> list:
        """Each member's tensors: its slice of the placed ones (output dim), its own copies of the others."""
        out, offset = [], 0
        for i, size in enumerate(sizes):
            member = {name: t[:, offset:offset + size].contiguous() for name, t in tensors.items() if t.dim() == 2
                      and name != "qzeros"}
            member.update({name: copies[i] for name, copies in shards.items()})
            out.append(member)
            offset += size
        return out

    def _module(self, name: str, tensors: dict, bias, dtype: torch.dtype) -> nn.Module:
        """The quantkit module of one layer (or fused layer) over its loaded tensors (and vLLM's bias), checked as
        load_quantized checks a checkpoint's. Integer layers stay QuantLinear on the CPU too: load_quantized's
        repacking for torch's int4 GEMM (quantkit.nn.cpu_int4_linear) crashes vLLM's AMX attention kernels in the
        same process (SIGILL in cpu_attention_with_kv_cache, vLLM CPU 0.32, bf16, on a CPU with AMX)."""
        where = f"vLLM layer {self.prefix}"
        named = {f"{name}.{suffix}": t for suffix, t in tensors.items()}
        info = quantkit_format.read_layer(name, self.settings, named, where)
        module = QuantkitCodec.build_module(dataclasses.replace(info, bias=bias is not None), self.config.qc, dtype)
        device = next(iter(tensors.values())).device
        for suffix, t in {**tensors, "bias": bias}.items():
            if t is not None:
                setattr(module, suffix, t)
        if isinstance(module, DecodedLinear):
            module.build_codebook(device)
        return module.to(device)  # on a GPU: reserves the kernels' workspace (quantkit.kernels.dispatch)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        runtime = layer.__dict__["_quantkit_runtime"]
        if torch.compiler.is_compiling():
            y = torch.ops.quantkit_vllm.linear(x, layer.__dict__["_quantkit_name"], runtime.out_features)
        else:
            y = runtime(x)
        return y if bias is None or layer.__dict__["_quantkit_bias_inside"] else y + bias


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: quant_method "quantkit" in its quantization registry (idempotent:
    vLLM calls it in every process, and registering a name again replaces it)."""
    register_quantization_config(METHOD)(QuantkitConfig)

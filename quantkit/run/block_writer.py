"""BlockWriter: what a streamed quantize run has written so far, block by block, into the staging folder.

Each finished block is one part file (quantkit.checkpoint.shards): its packed layers, its other tensors, and in its
metadata what the config and report need of each layer. The writer keeps only light per-layer summaries (codes and
parameters on the meta device), so a block's int32 codes are never all held at once. restore() reads the
summaries back from an interrupted run's parts and replay() rebuilds a finished block for --resume
(quantkit.run.resume); assemble the parts with quantkit.checkpoint.shards.assemble(folder, writer.order()).
"""
import dataclasses
import math

import torch

from quantkit.checkpoint import codecs, shards
from quantkit.checkpoint.quantkit_format import layer_settings, quantizer_of
from quantkit.core.errors import QuantkitError
from quantkit.core.result import QuantResult
from quantkit.models.arch import is_conv1d
from quantkit.core.memory import return_freed_memory
from quantkit.models.stream import assign_tensor
from quantkit.run import resume as resume_state
from quantkit.schemes.rotation import Rotation

# A layer's work (its Hessian, the inverse's factor, weight copies: about 4 * in * (in + out) bytes) is freed
# before the next layer's. Handing those pages back to the OS walks the heap (≈ 7 ms here): worth it after a wide
# layer, while after a small one (all of SmolLM2's: 210 trims were 1.5 s of a 120 s GPTQ run) the trim after each
# block suffices. At 64 MiB, bench_scale's 2048-wide layers went untrimmed and its GPTQ peak rose 1.33 -> 1.38 GB;
# at 16 MiB it is 1.30 GB, as with a trim after every layer.
LAYER_TRIM_BYTES = 16 << 20


def check_finite_result(name: str, res: QuantResult) -> None:
    """A guard behind the input checks: a NaN scale or error must never reach a checkpoint."""
    params_finite = all(bool(torch.isfinite(v).all()) for v in res.params.values())
    if not params_finite or not math.isfinite(res.stats.get("error") or 0.0):
        raise QuantkitError(f"quantizing {name} gave NaN/Inf values although its inputs were finite: "
                            "try a larger --damp (e.g. 0.1) or --method rtn, and please report it")


class BlockWriter:
    def __init__(self, source, arch, config, codec, save_dtype, method):
        self.source, self.arch, self.config, self.codec, self.save_dtype = source, arch, config, codec, save_dtype
        self.method = method
        self.summaries, self.packed, self.folder, self.device = {}, [], None, "cpu"
        self.pending = {}  # {layer: (its checkpoint tensors, resume-only tensors, metadata)} until its block is saved

    def pack(self, name, res):
        """A layer as soon as it is quantized: checked, packed, its codes dropped; returns the summary."""
        rows, cols = res.shape
        if 4 * cols * (cols + rows) >= LAYER_TRIM_BYTES:
            return_freed_memory()  # what the previous layer's work left in the heap
        check_finite_result(name, res)
        codecs.codec_for({name: res}, self.config.checkpoint_format)  # a format's refusals, layer by layer
        bias = getattr(res, "bias", None)
        tensors = {f"{name}.{suffix}": t.cpu() for suffix, t in self.codec.layer_tensors(
            res, self.config, self.save_dtype if bias is not None else None).items()}
        extra = {f"{shards.RESUME_PREFIX}{name}.g_idx": res.g_idx.to(torch.int32).cpu().clone()}  # for the summary
        info = {"settings": layer_settings(res), "stats": res.stats, "shape": list(res.shape),
                "params": {k: list(v.shape) for k, v in res.params.items()}}
        self.pending[name] = (tensors, extra, info)
        return _summary(res)

    def save_block(self, tmp, i, block, results):
        results = {n: r if n in self.pending else self.pack(n, r) for n, r in results.items()}
        prefix = f"{self.arch.blocks}.{i}"
        tensors = self._block_tensors(prefix, results)
        layers, packed = {}, []
        for module in results:
            layer_tensors, extra, layers[module] = self.pending.pop(module)
            tensors.update(layer_tensors)
            tensors.update(extra)
            packed += list(layer_tensors)
        prepared = {name: {k: v for k, v in found.items() if k.startswith(prefix + ".")}
                    for name, found in self.method.prepare_report.items()}
        shards.save_part(tmp, resume_state.block_key(i), tensors, {"packed": packed, "layers": layers,
                                                                   "prepared": prepared})
        self.packed += packed
        self.summaries.update(results)

    def _block_tensors(self, prefix, results) -> dict:
        """The block's tensors that are not packed layers, in the stored dtype, plus (for --resume) the exact
        in-loop value of every float tensor the stored dtype rounds (AWQ-scaled norms)."""
        tensors = {}
        for name in self.source.under(prefix):
            module, _, leaf = name.rpartition(".")
            t = getattr(self.source.model.get_submodule(module), leaf).detach()
            if module not in results or leaf not in ("weight", "bias"):
                tensors[name] = t.to(self.save_dtype) if t.is_floating_point() else t
            if t.is_floating_point() and t.dtype != self.save_dtype and not (module in results and leaf == "weight"):
                tensors[shards.RESUME_PREFIX + name] = t
        return tensors

    def restore(self, tmp, start: int, device) -> int:
        """Summaries, packed names and preparations' (AWQ's) report of the blocks 0..start-1 an interrupted run finished; start."""
        self.folder, self.device = tmp, device
        for i in range(start):
            info = shards.part_info(tmp, resume_state.block_key(i))
            g_idx = shards.read_part(tmp, resume_state.block_key(i), prefix=shards.RESUME_PREFIX)
            for module, layer in info["layers"].items():
                self.summaries[module] = _restored_summary(layer, g_idx[f"{shards.RESUME_PREFIX}{module}.g_idx"])
            self.packed += info["packed"]
            for name, found in info["prepared"].items():
                self.method.prepare_report.setdefault(name, {}).update(found)
        return start

    def replay(self, i: int):
        """Block i as the interrupted run left it after quantizing it: decoded weights in its linears, every
        other tensor at its exact in-loop value; for forwarding only."""
        key, prefix = resume_state.block_key(i), f"{self.arch.blocks}.{i}"
        layers = shards.part_info(self.folder, key)["layers"]
        tensors = shards.read_part(self.folder, key)
        for name in self.source.under(prefix):
            module, _, leaf = name.rpartition(".")
            if module in layers and leaf == "weight":
                part = {k: v.to(self.device) for k, v in tensors.items() if k.startswith(module + ".")}
                w = self._written_layer(part, module, layers[module]["settings"]).dequantize()
                if is_conv1d(self.source.model.get_submodule(module)):
                    w = w.t()
                value = w.to(self.source.dtype).cpu()
            else:
                value = tensors.get(shards.RESUME_PREFIX + name, tensors[name])
            assign_tensor(self.source.model, name, value.contiguous())
        return self.source.model.get_submodule(prefix)

    def _written_layer(self, tensors: dict, name: str, settings: dict) -> QuantResult:
        """One layer back from the tensors the codec wrote for it (settings: its quantizer, group size and
        rotation, as the quantkit format lists them). Exact: codes, fp16 scales, integer zeros and rotation signs
        round-trip unchanged, so dequantize() equals the weight the run computed with, bit for bit."""
        res = self.codec.layer_result(tensors, name, settings, self.config.checkpoint_format)
        rotation = settings.get("rotation")
        if rotation is not None:
            rotation = Rotation(tensors[f"{name}.rot_signs"].to(torch.int8), rotation["block"], rotation["seed"])
        return dataclasses.replace(res, quantizer=quantizer_of(settings), rotation=rotation, bias=None)

    def save_outside(self, tmp):
        """Embeddings, final norm, lm_head (unless quantized): one tensor at a time from the source, in the stored
        dtype; then the tensors the model does not load (carried), as stored."""
        quantized = self._quantized_tensors()  # a quantized lm_head is a packed layer of its own part
        outside = [n for n in self.source.names if not n.startswith(self.arch.blocks + ".") and n not in quantized]
        for j, name in enumerate(outside):
            shards.save_part(tmp, f"top-{j:05d}", self.source.read([name], self.save_dtype))
            return_freed_memory()
        for j, name in enumerate(self.carried):
            shards.save_part(tmp, f"carried-{j:05d}", self.source.read_unloaded([name]))

    @property
    def carried(self) -> list[str]:
        """The source's tensors the model does not load (MTP layers), carried unchanged under their names in the
        files, into a safetensors checkpoint (a GGUF file holds only what its architecture names)."""
        return list(self.source.unloaded) if self.codec.safetensors else []

    def order(self) -> list[str]:
        """The checkpoint's tensor order: unquantized tensors in state-dict order, then packed layers, then the
        carried ones."""
        quantized = self._quantized_tensors()
        return [n for n in self.source.names if n not in quantized] + self.packed + self.carried

    def _quantized_tensors(self) -> set:
        """The source's float tensors the packed layers replace (their weights and biases)."""
        return {f"{m}.{leaf}" for m in self.summaries for leaf in ("weight", "bias")}


def _restored_summary(layer: dict, g_idx):
    """The summary of a layer an interrupted run finished, from its part's metadata."""
    s = layer["settings"]
    rotation = None
    if s["rotation"] is not None:
        signs = torch.empty(layer["shape"][1], dtype=torch.int8, device="meta")
        rotation = Rotation(signs, s["rotation"]["block"], s["rotation"]["seed"])
    return QuantResult(codes=torch.empty(layer["shape"], device="meta"), g_idx=g_idx,
                       quantizer=quantizer_of(s), group_size=s["group_size"], rotation=rotation,
                       stats=layer["stats"],
                       params={k: torch.empty(v, device="meta") for k, v in layer["params"].items()})


def _summary(res):
    """A QuantResult without its big tensors (meta): what the report and quantization_config read (g_idx, [in]
    int32, is kept: desc_act is decided from its order)."""
    meta = {k: torch.empty(v.shape, device="meta") for k, v in res.params.items()}
    return dataclasses.replace(res, codes=torch.empty(res.codes.shape, device="meta"), params=meta, bias=None)

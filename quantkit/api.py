"""Python API: quantize() a model into a checkpoint folder; load_quantized() it back."""
import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from quantkit.algorithms.method import Method
from quantkit.calibration import distributed
from quantkit.calibration.sequential import calibrated_blocks, data_free_blocks
from quantkit.checkpoint import codecs
from quantkit.checkpoint import files as checkpoint
from quantkit.checkpoint import quantkit_format, shards
from quantkit.core.errors import QuantkitError
from quantkit.core.version import __version__
from quantkit.models.arch import (arch_for, check_window, fused_groups, fused_siblings, get_submodule,
                                  require_scale_groups)
from quantkit.models.hub import resolve_device
from quantkit.models.stream import open_model, return_freed_memory
from quantkit.run import output
from quantkit.run import resume as resume_state
from quantkit.run.config import QuantConfig, write_recipe
from quantkit.run.load import load_quantized  # noqa: F401  (public API)
from quantkit.run.precheck import check_compat, layer_specs, quantizable_linears
from quantkit.run.report import flag_outliers

REPORT_NAME = checkpoint.REPORT_NAME
RECIPE_NAME = checkpoint.RECIPE_NAME


def _check_finite_results(results) -> None:
    """A guard behind the input checks: a NaN scale or error must never reach a checkpoint."""
    for name, res in results.items():
        params_finite = all(bool(torch.isfinite(v).all()) for v in res.params.values())
        if not params_finite or not math.isfinite(res.stats.get("error") or 0.0):
            raise QuantkitError(f"quantizing {name} gave NaN/Inf values although its inputs were finite: "
                                "try a larger --damp (e.g. 0.1) or --method rtn, and please report it")


def _layer_report(results) -> dict:
    return {name: {"quantizer": r.quantizer.name, **r.quantizer.settings(), "group_size": r.group_size,
                   "rotation": r.rotation.settings() if r.rotation is not None else None,
                   "shape": list(r.shape), "bits_per_weight": round(r.bits_per_weight(), 4), **r.stats}
            for name, r in results.items()}


def quantize(model: str, out, config: QuantConfig | None = None, device: str = "auto", dtype: str = "auto",
             overwrite: bool = False, calibration_ids=None, resume: bool = False, resumable: bool = True,
             trust_remote_code: bool = False) -> dict:
    """Quantize `model` (hub id or folder) into the checkpoint folder `out`; returns the report.

    The fp model is never held whole (quantkit.models.stream): one decoder block at a time is read from the
    source's safetensors shards, quantized, packed into the staging folder and released.
    calibration_ids: optional LongTensor [nsamples, seqlen] used instead of loading config.dataset.
    resume: continue the interrupted run of `out` (quantkit.run.resume) after its last finished block; the
    checkpoint is the one an uninterrupted run writes. Without it, an interrupted run of `out` is an error.
    resumable: keep the finished blocks when the run is stopped from outside (Ctrl-C, SIGTERM, out of memory,
    a full disk) so that resume can continue it; False deletes them like any failure (`quantkit demo`).
    Under torchrun (quantkit.calibration.distributed) every process calls this; rank 0 writes and returns the report, the
    others return None. trust_remote_code: run the model's own code (config.json auto_map); off by default.
    """
    config = config or QuantConfig()
    if config.needs_calibration and calibration_ids is None:
        from quantkit.calibration.data import check_dataset

        check_dataset(config.dataset)  # a typo in --dataset is named before the model loads
    group, device = distributed.from_environment(resolve_device(device))  # under torchrun: this process's share
    with contextlib.closing(group):  # a process group started here ends here, on every rank
        if group.active:
            distributed.check_supported(config, resume)
        if not group.is_writer:
            return _follow(group, model, config, device, dtype, calibration_ids, trust_remote_code)
        return _write(group, model, out, config, device, dtype, overwrite, calibration_ids, resume, resumable,
                      trust_remote_code)


def _write(group, model, out, config, device, dtype, overwrite, calibration_ids, resume, resumable, trust_remote_code):
    """quantize() on the process that writes (the only one, or rank 0 under torchrun)."""
    out_path = output.claim_output(out, overwrite, sources=[model], resume=resume)  # before any heavy work
    partial = (output.partial_runs(out_path) or [None])[0] if resume else None
    t_start = time.perf_counter()
    compute_dtype = _compute_dtype(device, dtype)
    source, tokenizer, declared = open_model(model, compute_dtype, trust_remote_code)
    fp_model = source.model
    save_dtype = declared if dtype == "auto" else source.dtype
    arch = arch_for(fp_model)
    names = quantizable_linears(fp_model, arch)
    config.bind_fused_groups(fused_siblings(arch, names))
    specs, shapes = layer_specs(fp_model, names, config)
    for override in config.unmatched_overrides(names):
        print(f"warning: {override} matches none of the model's {len(names)} quantizable linears (such as "
              f"{names[-1]}): it changes nothing; check its spelling", file=sys.stderr)
    if all(s is None for s in specs.values()):
        raise QuantkitError(f"the recipe's module overrides skip all {len(names)} quantizable linears: nothing to "
                            "quantize; remove a skip: true or narrow its pattern")
    compat_lines = check_compat(config, arch, names, specs, shapes)
    method = Method(config, arch)
    codec = codecs.codec_for_settings(config.checkpoint_format, {s.quantizer().name for s in specs.values() if s},
                                      config.rotate != "none")
    if config.needs_calibration:
        if method.use_awq:
            require_scale_groups(arch, fp_model.config.model_type)
        calibration_ids = _calibration(config, tokenizer, calibration_ids, fp_model.config)
    n_blocks = len(get_submodule(fp_model, arch.blocks))
    fingerprint = resume_state.fingerprint(model, config, device, compute_dtype, n_blocks,
                                           calibration_ids if config.needs_calibration else None)
    if partial is not None:
        resume_state.check(partial, fingerprint)  # refused: the folder is left as it was
    elif resume:
        print(f"note: no interrupted run of {out} to resume: starting at block 0", file=sys.stderr)
    job = _Job(source, arch, config, codec, save_dtype, method)
    keep = (lambda folder: resume_state.progress(folder, n_blocks)) if resumable else None
    with output.staged_folder(out, overwrite, sources=[model], adopt=partial, keep=keep) as tmp:
        if partial is None:
            resume_state.write(tmp, fingerprint)
            start = 0
        else:
            resume_state.clean(tmp)
            start = job.restore(tmp, resume_state.finished_blocks(tmp), device)
            finished = "block 0" if start == 1 else f"blocks 0-{start - 1}"
            print(f"resuming {out}: {finished} of {n_blocks} {'is' if start == 1 else 'are'} done", file=sys.stderr)
        if start == n_blocks:
            blocks = (b for b in ())
        elif config.needs_calibration:
            # Stage by stage also for RTN rounding (awq), which ignores the data: its error report then sees the
            # inputs the layer will really get, and with the replayed submodules the stages cost one block forward
            # in all, where one observing pass and a final forward of the whole block cost two.
            blocks = calibrated_blocks(source, arch, calibration_ids, method, device, config.true_sequential,
                                       start=start, replay=job.replay, on_result=job.pack, group=group)
        else:  # data-free: the same per-layer path, without an observer
            blocks = data_free_blocks(source, arch, method, start=start, on_result=job.pack)
        # closing: a failure ends the generator (and its progress bar) before the error line is printed
        with contextlib.closing(blocks):
            for i, block, results in blocks:
                job.save_block(tmp, i, block, results)
                return_freed_memory()
        job.save_outside(tmp)
        report = {
            "quantkit_version": __version__, "model": _source_name(model), "method": config.method,
            "seconds": round(time.perf_counter() - t_start, 2), "device": device,
            "layers": _layer_report(job.summaries),
        }
        if start:
            report["resumed_at_block"] = start
        report["flagged"] = flag_outliers(report["layers"])
        report["compat"] = compat_lines
        if method.awq_report:
            report["awq"] = method.awq_report
        shards.assemble(tmp, job.order(), checkpoint.parse_size(config.max_shard_size))
        resume_state.finish(tmp)
        _write_configs(tmp, fp_model, tokenizer, job.summaries, names, config, method, report, save_dtype, codec)
    return report


def _source_name(model) -> str:
    """The source as the report records it: a local folder as an absolute path (what `eval compare` reads back
    from any working directory), a hub id as given."""
    folder = Path(model).expanduser()  # as open_model reads it
    return str(folder.resolve()) if folder.is_dir() else str(model)


def _compute_dtype(device, dtype):
    """Calibrate in fp32 on CPU (the checkpoint keeps the source's dtype): half-precision activations round the codes
    worse (docs/QUALITY.md: SmolLM2 w3 66.3 against 64.8 ppl in bf16) and most CPUs lack fast bf16 matmuls."""
    return "float32" if device == "cpu" and dtype == "auto" else dtype


def _calibration(config: QuantConfig, tokenizer, calibration_ids, model_config):
    """The calibration windows [nsamples, seqlen]: the caller's, or read from config.dataset; no longer than the
    model's context."""
    if calibration_ids is not None:
        length = calibration_ids.shape[-1]
        check_window(model_config, length, f"calibration windows of {length} tokens")
        return calibration_ids
    check_window(model_config, config.seqlen, f"--seqlen {config.seqlen}")  # before the data is read
    from quantkit.calibration.data import calibration_ids as load_calibration

    return load_calibration(tokenizer, config.dataset, config.nsamples, config.seqlen, config.seed)


def _follow(group, model, config: QuantConfig, device, dtype, calibration_ids, trust_remote_code) -> None:
    """A torchrun process other than rank 0: the same block loop on its share of the samples, nothing written
    (rank 0 checks OUT and writes the checkpoint). Data-free methods leave all the work to rank 0."""
    if not config.needs_calibration:
        return None
    source, tokenizer, _ = open_model(model, _compute_dtype(device, dtype), trust_remote_code)
    arch = arch_for(source.model)
    config.bind_fused_groups(fused_siblings(arch, quantizable_linears(source.model, arch)))
    method = Method(config, arch)
    ids = _calibration(config, tokenizer, calibration_ids, source.model.config)
    blocks = calibrated_blocks(source, arch, ids, method, device, config.true_sequential, group=group)
    with contextlib.closing(blocks):
        for _ in blocks:
            return_freed_memory()
    return None


# A layer's work (its Hessian, the inverse's factor, weight copies: about 4 * in * (in + out) bytes) is freed
# before the next layer's. Handing those pages back to the OS walks the heap (≈ 7 ms here): worth it after a wide
# layer, while after a small one (all of SmolLM2's: 210 trims were 1.5 s of a 120 s GPTQ run) the trim after each
# block suffices. At 64 MiB, bench_scale's 2048-wide layers went untrimmed and its GPTQ peak rose 1.33 -> 1.38 GB;
# at 16 MiB it is 1.30 GB, as with a trim after every layer.
LAYER_TRIM_BYTES = 16 << 20


class _Job:
    """What a streamed run has written so far: each block's part (packed layers, its other tensors, and in its
    metadata what the config and report need of each layer), the light per-layer summaries (codes and
    parameters dropped). restore() reads them back from an interrupted run's parts, replay() rebuilds a
    finished block for --resume (quantkit.run.resume)."""

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
        _check_finite_results({name: res})
        if self.config.checkpoint_format in codecs.STRICT:
            codecs.codec_for({name: res}, self.config.checkpoint_format)  # a strict format's refusals, by layer
        bias = getattr(res, "bias", None)
        tensors = {f"{name}.{suffix}": t.cpu() for suffix, t in self.codec.layer_tensors(
            res, self.config, self.save_dtype if bias is not None else None).items()}
        extra = {f"{shards.RESUME_PREFIX}{name}.g_idx": res.g_idx.to(torch.int32).cpu().clone()}  # for the summary
        info = {"settings": quantkit_format._layer_settings(res), "stats": res.stats, "shape": list(res.shape),
                "params": {k: list(v.shape) for k, v in res.params.items()}}
        self.pending[name] = (tensors, extra, info)
        return _summary(res)

    def save_block(self, tmp, i, block, results):
        results = {n: r if n in self.pending else self.pack(n, r) for n, r in results.items()}
        prefix = f"{self.arch.blocks}.{i}"
        tensors, packed = {}, []
        for name in self.source.under(prefix):
            module, _, leaf = name.rpartition(".")
            t = getattr(self.source.model.get_submodule(module), leaf).detach()
            if module not in results or leaf not in ("weight", "bias"):
                tensors[name] = t.to(self.save_dtype) if t.is_floating_point() else t
            if t.is_floating_point() and t.dtype != self.save_dtype and not (module in results and leaf == "weight"):
                tensors[shards.RESUME_PREFIX + name] = t  # the exact in-loop value (AWQ-scaled norms), for --resume
        layers = {}
        for module in results:
            layer_tensors, extra, layers[module] = self.pending.pop(module)
            tensors.update(layer_tensors)
            tensors.update(extra)
            packed += list(layer_tensors)
        awq = {k: v for k, v in self.method.awq_report.items() if k.startswith(prefix + ".")}
        shards.save_part(tmp, resume_state.block_key(i), tensors, {"packed": packed, "layers": layers, "awq": awq})
        self.packed += packed
        self.summaries.update(results)

    def restore(self, tmp, start: int, device) -> int:
        """Summaries, packed names and AWQ report of the blocks 0..start-1 an interrupted run finished; start."""
        self.folder, self.device = tmp, device
        for i in range(start):
            info = shards.part_info(tmp, resume_state.block_key(i))
            g_idx = shards.read_part(tmp, resume_state.block_key(i), prefix=shards.RESUME_PREFIX)
            for module, layer in info["layers"].items():
                self.summaries[module] = _restored_summary(layer, g_idx[f"{shards.RESUME_PREFIX}{module}.g_idx"])
            self.packed += info["packed"]
            self.method.awq_report.update(info["awq"])
        return start

    def replay(self, i: int):
        """Block i as the interrupted run left it after quantizing it: decoded weights in its linears, every
        other tensor at its exact in-loop value; for forwarding only."""
        from quantkit.models.arch import is_conv1d
        from quantkit.models.stream import _assign

        key, prefix = resume_state.block_key(i), f"{self.arch.blocks}.{i}"
        layers = shards.part_info(self.folder, key)["layers"]
        tensors = shards.read_part(self.folder, key)
        for name in self.source.under(prefix):
            module, _, leaf = name.rpartition(".")
            if module in layers and leaf == "weight":
                part = {k: v.to(self.device) for k, v in tensors.items() if k.startswith(module + ".")}
                res = codecs.layer_result(self.codec, part, module, layers[module]["settings"],
                                          self.config.checkpoint_format)
                w = res.dequantize()
                if is_conv1d(self.source.model.get_submodule(module)):
                    w = w.t()
                value = w.to(self.source.dtype).cpu()
            else:
                value = tensors.get(shards.RESUME_PREFIX + name, tensors[name])
            _assign(self.source.model, name, value.contiguous())
        return self.source.model.get_submodule(prefix)

    def save_outside(self, tmp):
        """Embeddings, final norm, lm_head: one tensor at a time from the source, in the stored dtype."""
        outside = [n for n in self.source.names if not n.startswith(self.arch.blocks + ".")]
        for j, name in enumerate(outside):
            shards.save_part(tmp, f"top-{j:05d}", self.source.read([name], self.save_dtype))
            return_freed_memory()

    def order(self) -> list[str]:
        """The order the in-memory writer used: unquantized tensors in state-dict order, then packed layers."""
        quantized = {f"{m}.{leaf}" for m in self.summaries for leaf in ("weight", "bias")}
        return [n for n in self.source.names if n not in quantized] + self.packed


def _restored_summary(layer: dict, g_idx):
    """The summary of a layer an interrupted run finished, from its part's metadata."""
    from quantkit.core.result import QuantResult
    from quantkit.schemes.rotation import Rotation

    s = layer["settings"]
    rotation = None
    if s["rotation"] is not None:
        signs = torch.empty(layer["shape"][1], dtype=torch.int8, device="meta")
        rotation = Rotation(signs, s["rotation"]["block"], s["rotation"]["seed"])
    return QuantResult(codes=torch.empty(layer["shape"], device="meta"), g_idx=g_idx,
                       quantizer=quantkit_format._quantizer(s), group_size=s["group_size"], rotation=rotation,
                       stats=layer["stats"],
                       params={k: torch.empty(v, device="meta") for k, v in layer["params"].items()})


def _summary(res):
    """A QuantResult without its big tensors (meta): what the report and quantization_config read (g_idx, [in]
    int32, is kept: desc_act is decided from its order)."""
    meta = {k: torch.empty(v.shape, device="meta") for k, v in res.params.items()}
    return dataclasses.replace(res, codes=torch.empty(res.codes.shape, device="meta"), params=meta, bias=None)


def _write_configs(tmp, model, tokenizer, results, names, config, method, report, save_dtype, codec):
    qc = codec.quantization_config(config, results, names, act_order=method.act_order, extra={
        "true_sequential": config.true_sequential, "damp_percent": config.damp,
        "quantizer": [f"quantkit:{__version__}"], "meta": {"method": config.method}},
        fused=fused_groups(method.arch, names))
    model_config = model.config.to_dict()
    model_config["dtype"] = str(save_dtype).removeprefix("torch.")
    model_config["quantization_config"] = qc
    checkpoint.write_json(tmp / "config.json", model_config)
    checkpoint.write_json(tmp / "quantize_config.json", qc)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    write_recipe(config, tmp / RECIPE_NAME)
    report["files"] = output.file_list(tmp)  # what lets a later --overwrite recognise the folder as ours
    checkpoint.write_json(tmp / REPORT_NAME, report)

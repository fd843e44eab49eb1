"""The quantize pipeline: source model -> pre-checks -> block loop -> staged parts -> checkpoint folder.

quantize() (quantkit.api re-exports it) splits the work between the process that writes (the only one, or rank 0
under torchrun) and the others, which calibrate on their share of the samples. The writer plans the run before any
heavy work (prepare: every refusal the settings alone decide), quantizes block by block into a staging folder
(quantkit.run.block_writer), and assembles the shards and configs at the end; the staging folder is renamed into
place only when everything is written (quantkit.run.output).
"""
import contextlib
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from quantkit.algorithms.method import Method
from quantkit.calibration import distributed
from quantkit.calibration.capture import trace_blocks
from quantkit.calibration.data import calibration_ids as load_calibration
from quantkit.calibration.data import check_dataset
from quantkit.calibration.sequential import calibrated_blocks, check_activation_memory, data_free_blocks
from quantkit.checkpoint import compat, files
from quantkit.core.errors import QuantkitError
from quantkit.core.memory import return_freed_memory
from quantkit.core.version import __version__
from quantkit.models.arch import arch_for, check_window, fused_groups, fused_siblings, get_submodule, vocabulary
from quantkit.models.head import head_paths, untie
from quantkit.models.hub import resolve_device
from quantkit.models.names import FileNames
from quantkit.models.stream import open_model
from quantkit.run import allocate, output
from quantkit.run import folder as checkpoint_folder
from quantkit.run import resume as resume_state
from quantkit.run.block_writer import BlockWriter
from quantkit.run.config import QuantConfig
from quantkit.run.coverage import expert_calibration, weight_coverage
from quantkit.run.precheck import (check_compat, file_aliases, fused_expert_linears, kept_head, layer_specs,
                                   quantizable_linears, writer_codec)
from quantkit.run.report import flag_outliers


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
    Under torchrun (quantkit.calibration.distributed) every process calls this; rank 0 writes and returns the
    report, the others return None. trust_remote_code: run the model's own code (config.json auto_map); off by
    default.
    """
    config = config or QuantConfig()
    if config.needs_calibration and calibration_ids is None:
        check_dataset(config.dataset)  # a typo in --dataset is named before the model loads
        _check_calibration_fits(model, config)
    group, device = distributed.from_environment(resolve_device(device))  # under torchrun: this process's share
    with contextlib.closing(group):  # a process group started here ends here, on every rank
        if group.active:
            distributed.check_supported(config, resume)
        if not group.is_writer:
            return _follow(group, model, config, device, dtype, calibration_ids, trust_remote_code)
        return _write(group, model, out, config, device, dtype, overwrite, calibration_ids, resume, resumable,
                      trust_remote_code)


def _check_calibration_fits(model, config) -> None:
    """--nsamples x --seqlen whose activations could not be held even in 16 bits, refused before the model loads
    (a local folder's config.json gives the hidden size; the exact check follows once the dtype is known)."""
    folder = Path(str(model)).expanduser()
    if not (folder / "config.json").is_file():
        return
    try:
        hidden = json.loads((folder / "config.json").read_text()).get("hidden_size")
    except (OSError, ValueError, AttributeError):
        return  # the model's loader says what is wrong with config.json
    check_activation_memory(SimpleNamespace(hidden_size=hidden), (config.nsamples, config.seqlen), torch.float16, "cpu")


@dataclass
class Plan:
    """What the writer knows once the source is open and every pre-check has passed."""
    source: object          # quantkit.models.stream.StreamedModel
    tokenizer: object
    save_dtype: object      # the dtype the checkpoint stores its float tensors in
    compute_dtype: str
    arch: object
    names: list             # the quantizable linears
    method: Method
    codec: type             # the codec that writes the layers
    compat_lines: list      # the readers' refusals, as warning lines
    coverage: object        # what is quantized and what stays in float (quantkit.run.coverage)
    in_files: object        # the names the checkpoint gives the model's tensors (quantkit.models.names)
    calibration_ids: object  # [nsamples, seqlen] or None (data-free)
    traced: list            # each block's weights by use (quantkit.models.uses.BlockUses)
    config: QuantConfig     # the run's settings, with --target-bits's allocation as recipe overrides
    allocation: dict        # what --target-bits chose (quantkit.run.allocate.report), None without it
    head: object = None     # quantkit.models.head.HeadPaths when lm_head is quantized (--lm-head)

    @property
    def n_blocks(self) -> int:
        return len(get_submodule(self.source.model, self.arch.blocks))

    @property
    def n_parts(self) -> int:
        """The units the loop saves as parts: the blocks, and lm_head after them when it is quantized."""
        return self.n_blocks + (self.head is not None)


def prepare(model, config, device, dtype, trust_remote_code, calibration_ids) -> Plan:
    """Open the source and decide everything the settings decide: a refusal comes here, before any work."""
    compute_dtype = _compute_dtype(device, dtype)
    needs_text = (config.needs_calibration or config.target is not None) and calibration_ids is None
    source, tokenizer, declared = open_model(model, compute_dtype, trust_remote_code, tokenizer_required=needs_text)
    fp_model = source.model
    arch = arch_for(fp_model)
    head = head_paths(fp_model) if config.lm_head else None
    traced = trace_blocks(source, arch, device)  # what each weight is, by how the forward uses it
    names = quantizable_linears(fp_model, arch, head, traced)
    siblings = fused_siblings(arch, names)
    in_files = FileNames(fp_model)  # the names the checkpoint and the report give the model's tensors
    specs, shapes = layer_specs(fp_model, names, config, siblings, in_files)
    head = kept_head(head, specs)
    coverage = weight_coverage(fp_model, arch.blocks, specs, config, traced)  # refuses weights it would lose
    if not names:
        raise QuantkitError(f"{model}: the forward of its decoder blocks ({arch.blocks}) multiplies no weight as a "
                            f"linear layer (what they hold: {coverage.summary().partition('; ')[2]}): nothing this "
                            "version can quantize")
    kept = [n.rpartition(".")[0] for n in coverage.kinds.get("recipe", {}) if n.rpartition(".")[0] not in specs]
    aliases = file_aliases(in_files, [*names, *kept])
    for override in config.unmatched_overrides([*names, *kept], siblings, aliases):
        print(f"warning: {override} matches none of the model's {len(names)} quantizable linears (such as "
              f"{names[-1]}): it changes nothing; check its spelling", file=sys.stderr)
    if all(s is None for s in specs.values()):
        raise QuantkitError(f"the recipe's module overrides skip all {len(names)} quantizable linears: nothing to "
                            "quantize; remove a skip: true or narrow its pattern")
    allocation = None
    save_dtype = declared if dtype == "auto" else source.dtype
    if config.target is not None:  # the run's recipe becomes the allocation (quantkit.run.allocate)
        calibration_ids = _calibration(config, tokenizer, calibration_ids, fp_model.config)
        config, allocation = _allocated(config, source, arch, names, specs, shapes, in_files, calibration_ids, device,
                                        save_dtype, tokenizer, Path(_source_name(model)).name)
        specs, shapes = layer_specs(fp_model, names, config, siblings, in_files)
    codec = writer_codec(config, specs)
    codec.check_source(fp_model.config.to_dict(), tokenizer, [in_files.of_tensor(n) for n in source.names])
    compat_lines = check_compat(config, arch, names, specs, shapes, fused_expert_linears(fp_model, arch, names),
                                compat.renamed_floats(coverage.kinds, in_files.of_tensor))
    method = Method(config, arch, specs)
    method.check_model(fp_model.config.model_type)
    if config.needs_calibration:
        calibration_ids = _calibration(config, tokenizer, calibration_ids, fp_model.config)
    return Plan(source, tokenizer, save_dtype, compute_dtype, arch, names, method, codec,
                compat_lines, coverage, in_files, calibration_ids if config.needs_calibration else None, traced, config,
                allocation, head)


def _allocated(config, source, arch, names, specs, shapes, in_files, ids, device, save_dtype, tokenizer, name):
    """(the config whose recipe gives each linear the setting --target-bits / --target-size chose, the report's entry
    saying what), the choice printed; measured before block 0, so a resumed run's fingerprint holds it. tokenizer and
    name: what a GGUF file's metadata holds (its size counts them)."""
    codec = writer_codec(config, specs)
    start = time.perf_counter()
    quantized = [n for n, s in specs.items() if s is not None]
    other = 0
    if config.target_size is not None and config.gguf_type:
        other = allocate.gguf_other_bytes(source, quantized, save_dtype, tokenizer, name, in_files)
    elif config.target_size is not None:
        other = allocate.other_bytes(source, quantized, save_dtype)
    chosen = allocate.allocate(config, codec, source, specs, shapes, fused_groups(arch, names), ids, device, other)
    lines = allocate.summary(chosen, shapes, codec, config, other)
    lines.append(f"  (sensitivity of {len(chosen.picked)} linears measured in {time.perf_counter() - start:.1f} s)")
    for line in lines:
        print(line, file=sys.stderr)
    derived = config.without_target([*config.modules, *allocate.as_overrides(chosen)])
    return derived, allocate.report(chosen, lines, config, in_files.of_module)


def _write(group, model, out, config, device, dtype, overwrite, calibration_ids, resume, resumable, trust_remote_code):
    """quantize() on the process that writes (the only one, or rank 0 under torchrun)."""
    out_path = output.claim_output(out, overwrite, sources=[model], resume=resume)  # before any heavy work
    partial = (output.partial_runs(out_path) or [None])[0] if resume else None
    t_start = time.perf_counter()
    target = config.target
    if partial is not None and target is not None:  # the interrupted run's allocation, not a new measurement
        config = resume_state.allocated_config(partial, config)
    plan = prepare(model, config, device, dtype, trust_remote_code, calibration_ids)
    config = plan.config
    if group.active and target is not None and config.needs_calibration:  # the allocation, measured here alone
        group.broadcast(config.modules, src=0, what="sending the allocation")
    fingerprint = resume_state.fingerprint(model, config, device, plan.compute_dtype, plan.n_blocks,
                                           plan.calibration_ids, target)
    if partial is not None:
        resume_state.check(partial, fingerprint)  # refused: the folder is left as it was
    elif resume:
        print(f"note: no interrupted run of {out} to resume: starting at block 0", file=sys.stderr)
    writer = BlockWriter(plan.source, plan.arch, config, plan.codec, plan.save_dtype, plan.method)
    keep = (lambda folder: resume_state.progress(folder, plan.n_blocks)) if resumable else None
    with output.staged_folder(out, overwrite, sources=[model], adopt=partial, keep=keep) as tmp:
        start = _start(tmp, partial, fingerprint, writer, device, out, plan.n_blocks)
        _quantize_parts(group, plan, config, writer, tmp, start, device)
        writer.save_outside(tmp)
        report = _report(model, config, device, plan, writer, start, time.perf_counter() - t_start)
        spec = _folder_spec(model, plan, writer, config)
        carried = set(writer.carried)  # named as in the source's files already
        checkpoint_folder.write_weights(tmp, spec, writer.order(),
                                        lambda n: n if n in carried else plan.in_files.of_tensor(n))
        resume_state.finish(tmp)  # the parts are in the shards: nothing left to resume, nothing for the report's list
        checkpoint_folder.write_rest(tmp, spec, report)
    return report


def _start(tmp, partial, fingerprint, writer, device, out, n_blocks) -> int:
    """The first block to quantize: 0 for a new run, the first unfinished one of a resumed run."""
    if partial is None:
        resume_state.write(tmp, fingerprint)
        return 0
    resume_state.clean(tmp)
    resume_state.set_aside_damaged(tmp)
    start = writer.restore(tmp, resume_state.finished_blocks(tmp), device)
    blocks = min(start, n_blocks)
    finished = "no block" if blocks == 0 else "block 0" if blocks == 1 else f"blocks 0-{blocks - 1}"
    finished += f" of {n_blocks}" + (" and lm_head" if start > n_blocks else "")
    print(f"resuming {out}: {finished} {'are' if start > 1 else 'is'} done", file=sys.stderr)
    return start


def _quantize_parts(group, plan, config, writer, tmp, start, device) -> None:
    """Every block from `start` on (and the quantized lm_head), each saved as a part as soon as it is quantized."""
    if start == plan.n_parts:
        return
    if config.needs_calibration:
        # Stage by stage also for RTN rounding (awq), which ignores the data: its error report then sees the
        # inputs the layer will really get, and with the replayed submodules the stages cost one block forward
        # in all, where one observing pass and a final forward of the whole block cost two.
        blocks = calibrated_blocks(plan.source, plan.arch, plan.calibration_ids, plan.method, device,
                                   config.true_sequential, start=start, replay=writer.replay,
                                   on_result=writer.pack, group=group, head=plan.head, traced=plan.traced)
    else:  # data-free: the same per-layer path, without an observer
        blocks = data_free_blocks(plan.source, plan.arch, plan.method, start=start, on_result=writer.pack,
                                  head=plan.head, traced=plan.traced)
    # closing: a failure ends the generator (and its progress bar) before the error line is printed
    with contextlib.closing(blocks):
        for i, block, results in blocks:
            writer.save_block(tmp, i, block, results)
            return_freed_memory()


def _report(model, config, device, plan, writer, start, seconds) -> dict:
    """The run's report, every layer, weight and expert under its name in the files."""
    of_module = plan.in_files.of_module
    layers = _layer_report(writer.summaries)
    report = {"quantkit_version": __version__, "model": _source_name(model), "method": config.method,
              "seconds": round(seconds, 2), "device": device, "layers": {of_module(n): v for n, v in layers.items()}}
    if start:
        report["resumed_at_block"] = start
    report["flagged"] = flag_outliers(report["layers"])
    report["compat"] = plan.compat_lines
    if plan.allocation:
        report["target_bits"] = plan.allocation
    report["coverage"] = {"summary": plan.coverage.summary(), **plan.coverage.to_report(plan.in_files.of_tensor)}
    if writer.carried:
        report["carried"] = writer.carried
        report["coverage"]["summary"] += f"; {carried_summary(writer.carried)}"
    experts = expert_calibration(layers, of_module)
    if experts:
        report["experts"] = experts
    for name, found in plan.method.prepare_report.items():  # "awq": its search per scale group
        report[name] = {of_module(n): v for n, v in found.items()}
    return report


def carried_summary(names) -> str:
    """'carried over unchanged: 24 tensors the model does not load (mtp.*)': the prefixes up to a layer number."""
    prefixes = {re.sub(r"^((?:[^.]+\.)*?\d+\.|[^.]+\.).*$", r"\1", n) for n in names}
    prefixes = sorted(p + "*" for p in prefixes if not any(p != q and p.startswith(q) for q in prefixes))
    shown = ", ".join(prefixes[:3]) + (", ..." if len(prefixes) > 3 else "")
    plural = "s" if len(names) != 1 else ""
    return f"carried over unchanged: {len(names)} tensor{plural} the model does not load ({shown})"


def _layer_report(results) -> dict:
    return {name: {"quantizer": r.quantizer.name, **r.quantizer.settings(), "group_size": r.group_size,
                   "rotation": r.rotation.settings() if r.rotation is not None else None,
                   "shape": list(r.shape), "bits_per_weight": round(r.bits_per_weight(), 4), **r.stats}
            for name, r in results.items()}


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
        return _within_vocabulary(calibration_ids, model_config, "the calibration ids given")
    check_window(model_config, config.seqlen, f"--seqlen {config.seqlen}")  # before the data is read
    ids = load_calibration(tokenizer, config.dataset, config.nsamples, config.seqlen, config.seed)
    return _within_vocabulary(ids, model_config, "the tokenizer beside the model")


def _within_vocabulary(ids, model_config, source: str):
    """ids, refused when one is past the model's vocabulary: the embedding lookup would fail mid-run with an index
    error (a tokenizer of another model beside the weights)."""
    vocab = vocabulary(model_config)
    if vocab > 2 and int(ids.max()) >= vocab:
        raise QuantkitError(f"{source} gives token id {int(ids.max())}, past the model's vocabulary of {vocab} "
                            "(config.json's vocab_size): the tokenizer is not this model's; put the model's own "
                            "tokenizer files beside it")
    return ids


def _follow(group, model, config: QuantConfig, device, dtype, calibration_ids, trust_remote_code) -> None:
    """A torchrun process other than rank 0: the same block loop on its share of the samples, nothing written
    (rank 0 checks OUT and writes the checkpoint). Data-free methods leave all the work to rank 0."""
    if not config.needs_calibration:
        return None
    if config.target is not None:  # rank 0 measures the allocation; every rank runs its recipe
        config = config.without_target(group.broadcast(None, src=0, what="sending the allocation"))
    source, tokenizer, _ = open_model(model, _compute_dtype(device, dtype), trust_remote_code)
    arch = arch_for(source.model)
    head = head_paths(source.model) if config.lm_head else None
    traced = trace_blocks(source, arch, device)
    names = quantizable_linears(source.model, arch, head, traced)
    specs, _ = layer_specs(source.model, names, config, fused_siblings(arch, names))
    head = kept_head(head, specs)
    method = Method(config, arch, specs)
    ids = _calibration(config, tokenizer, calibration_ids, source.model.config)
    blocks = calibrated_blocks(source, arch, ids, method, device, config.true_sequential, group=group, head=head,
                               traced=traced)
    with contextlib.closing(blocks):
        for _ in blocks:
            return_freed_memory()
    return None


def _model_config(plan, results, config) -> dict:
    """config.json as the checkpoint holds it: the source's, its dtype, quantization_config (and lm_head untied)."""
    of_module = plan.in_files.of_module
    names = [of_module(n) for n in plan.names]
    fused = {of_module(f): tuple(map(of_module, members)) for f, members in fused_groups(plan.arch, plan.names).items()}
    made_with = {"true_sequential": config.true_sequential, "damp_percent": config.damp,
                 "meta": {"method": config.method}}
    qc = checkpoint_folder.quantization_config(plan.codec, config, {of_module(n): r for n, r in results.items()}, names,
                                               plan.method.act_order, plan.head is not None, made_with, fused)
    model = plan.source.model
    model_config = model.config.to_dict()
    model_config["dtype"] = str(plan.save_dtype).removeprefix("torch.")
    model_config["quantization_config"] = qc
    if plan.head is not None:  # the embedding stays in float, lm_head is quantized: two tensors now
        untie(model_config)
    return model_config


def _folder_spec(model, plan, writer, config) -> checkpoint_folder.FolderSpec:
    """What the checkpoint folder is written from (quantkit.run.folder, the writer convert uses too)."""
    sidecars = checkpoint_folder.saved_sidecars(getattr(plan.source.model, "generation_config", None), plan.tokenizer)
    return checkpoint_folder.FolderSpec(plan.codec, _model_config(plan, writer.summaries, config), plan.tokenizer,
                                        Path(_source_name(model)).name, files.parse_size(config.max_shard_size),
                                        sidecars, recipe=config)

"""Python API: quantize() a model into a checkpoint folder; load_quantized() it back."""
import math
import sys
import time

import torch
from tqdm.auto import tqdm

from quantkit import __version__
from quantkit.config import QuantConfig, write_recipe
from quantkit.errors import QuantkitError
from quantkit.formats import checkpoint, codecs, compat, output
from quantkit.loading import load_quantized  # noqa: F401  (public API)
from quantkit.methods.registry import Method
from quantkit.model.arch import (arch_for, block_linears, fused_groups, fused_siblings, get_submodule, get_weight,
                                 is_linear, require_scale_groups)
from quantkit.model.loader import load_fp_model, resolve_device, stored_dtype
from quantkit.model.sequential import run_sequential
from quantkit.report import flag_outliers

REPORT_NAME = output.REPORT_NAME
RECIPE_NAME = checkpoint.RECIPE_NAME


def quantizable_linears(model, arch) -> list[str]:
    """Full names of the linears inside the decoder blocks (embeddings and lm_head are left alone)."""
    blocks = get_submodule(model, arch.blocks)
    names = []
    for i, block in enumerate(blocks):
        for rel in block_linears(arch):
            module = get_submodule(block, rel)
            if not is_linear(module):
                raise QuantkitError(f"{arch.blocks}.{i}.{rel} is a {type(module).__name__}, not a linear layer")
            names.append(f"{arch.blocks}.{i}.{rel}")
    return names


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
             overwrite: bool = False, calibration_ids=None) -> dict:
    """Quantize `model` (hub id or folder) into the checkpoint folder `out`; returns the report.

    calibration_ids: optional LongTensor [nsamples, seqlen] used instead of loading config.dataset.
    """
    config = config or QuantConfig()
    output.claim_output(out, overwrite, sources=[model])  # fail before any heavy work; the writer checks again
    device = resolve_device(device)
    t_start = time.perf_counter()
    # CPU half-precision matmuls are slow: calibrate in fp32 there, but write the source's dtype.
    compute_dtype = "float32" if device == "cpu" and dtype == "auto" else dtype
    fp_model, tokenizer = load_fp_model(model, compute_dtype)
    save_dtype = stored_dtype(fp_model) if dtype == "auto" else fp_model.dtype
    arch = arch_for(fp_model)
    names = quantizable_linears(fp_model, arch)
    config.bind_fused_groups(fused_siblings(arch, names))
    if all(config.spec_for(n) is None for n in names):
        raise QuantkitError(f"the recipe's module overrides skip all {len(names)} quantizable linears: nothing to "
                            "quantize; remove a skip: true or narrow its pattern")
    compat_lines = check_compat(fp_model, arch, names, config)
    method = Method(config, arch)
    if config.needs_calibration:
        if method.use_awq:
            require_scale_groups(arch, fp_model.config.model_type)
        if calibration_ids is None:
            from quantkit.data import calibration_ids as load_calibration

            calibration_ids = load_calibration(tokenizer, config.dataset, config.nsamples, config.seqlen, config.seed)
        # RTN rounding (awq) ignores the data, so stage-by-stage forwards would only refine the error
        # report: one observing pass per block is enough there.
        staged = config.true_sequential and method.use_gptq
        results = run_sequential(fp_model, arch, calibration_ids, method, device, staged)
    else:  # data-free: the same per-layer path, without an observer
        results = {n: method.quantize(n, None, fp_model.get_submodule(n))
                   for n in tqdm(names, desc=config.method, unit="linear") if config.spec_for(n) is not None}
    _check_finite_results(results)
    report = {
        "quantkit_version": __version__, "model": str(model), "method": config.method,
        "seconds": round(time.perf_counter() - t_start, 2), "device": device,
        "layers": _layer_report(results),
    }
    report["flagged"] = flag_outliers(report["layers"])
    report["compat"] = compat_lines
    if method.awq_report:
        report["awq"] = method.awq_report
    _write(fp_model, tokenizer, results, names, config, method, report, save_dtype,
           output.staged_folder(out, overwrite, sources=[model]))
    return report


def check_compat(model, arch, names, config) -> list[str]:
    """The readers that would refuse the checkpoint (quantkit.formats.compat), before any calibration:
    a QuantkitError for the --compat target, a warning line on stderr for each other reader."""
    specs = {n: config.spec_for(n) for n in names}
    shapes = {n: tuple(reversed(get_weight(model.get_submodule(n)).shape)) for n in names}
    codecs.precheck(config, specs, shapes)
    found = compat.enforce(compat.check(config, specs, shapes, fused_groups(arch, names)), config.compat)
    for line in found:
        print(f"warning: {line}", file=sys.stderr)
    return found


def _write(model, tokenizer, results, names, config, method, report, save_dtype, staged):
    codec = codecs.codec_for(results, config.checkpoint_format)
    qc = codec.quantization_config(config, results, names, act_order=method.act_order, extra={
        "true_sequential": config.true_sequential, "damp_percent": config.damp,
        "quantizer": [f"quantkit:{__version__}"], "meta": {"method": config.method}},
        fused=fused_groups(method.arch, names))
    state = checkpoint.drop_shared(model.state_dict())  # before casting, which would untie storages
    state = {k: v.to(save_dtype) if v.is_floating_point() else v for k, v in state.items()}
    tensors = codecs.model_tensors(state, results, codec, config)
    model_config = model.config.to_dict()
    model_config["dtype"] = str(save_dtype).removeprefix("torch.")
    model_config["quantization_config"] = qc
    with staged as tmp:
        checkpoint.write_tensors(tmp, tensors, checkpoint.parse_size(config.max_shard_size))
        checkpoint.write_json(tmp / "config.json", model_config)
        checkpoint.write_json(tmp / "quantize_config.json", qc)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_recipe(config, tmp / RECIPE_NAME)
        report["files"] = output.file_list(tmp)  # what lets a later --overwrite recognise the folder as ours
        checkpoint.write_json(tmp / REPORT_NAME, report)

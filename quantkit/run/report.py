"""What the CLI prints: the per-layer quantization table, inspect output, perplexity of a path."""
import math
import re
import statistics
from collections import Counter
from pathlib import Path

from quantkit.checkpoint import files as checkpoint
from quantkit.core.groups import group_index
from quantkit.kernels.dispatch import Backend, layer_backend
from quantkit.models.hub import resolve_device
from quantkit.nn.quant_linear import QuantLinear, grid_facts
from quantkit.run.load import checkpoint_dtype


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


# A layer is flagged when its output SQNR lies this far below the median of the layers of the same kind
# (same name in the other blocks): 6 dB is 4x the error power of a typical sibling.
OUTLIER_DB = 6.0


def flag_outliers(layers: dict) -> list:
    """Names of the layers whose SQNR is OUTLIER_DB below the median of their kind (e.g. every mlp.down_proj)."""
    kinds = {}
    for name, r in layers.items():
        if isinstance(r.get("sqnr_db"), (int, float)) and math.isfinite(r["sqnr_db"]):
            kinds.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append((name, r["sqnr_db"]))
    flagged = []
    for members in kinds.values():
        median = statistics.median(s for _, s in members)
        flagged += [name for name, s in members if s < median - OUTLIER_DB]
    return sorted(flagged)


def layer_table(report: dict) -> str:
    """Markdown table: per linear, bits/group, output fidelity on the calibration inputs, damping, seconds;
    layers far worse than their kind are marked (flag_outliers)."""
    flagged = set(report.get("flagged", []))
    rows = ["| layer | bits | group | rel. output error | cosine | SQNR dB | damp | seconds |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in report["layers"].items():
        mark = " **worse than its kind**" if name in flagged else ""
        rows.append(f"| {name}{mark} | {r['bits']} | {r['group_size']} | {_fmt(r.get('error'), '.3e')} | "
                    f"{_fmt(r.get('cosine'), '.6f')} | {_fmt(r.get('sqnr_db'), '.2f')} | {_fmt(r.get('damp'), 'g')} | "
                    f"{_fmt(r.get('seconds'), '.2f')} |")
    if flagged:
        rows.append(f"\n{len(flagged)} layer(s) have an output SQNR more than {OUTLIER_DB:g} dB below the median of "
                    "the same layer in the other blocks: consider more bits for them (recipe modules overrides)")
    return "\n".join(rows)


def _layer_sizes(tensors: dict, layers) -> dict:
    sizes = {}
    for layer in layers:
        k, n = layer.in_features, layer.out_features
        # bits per weight counts the codes and the per-group parameters; g_idx (32 bits per input column)
        # is not needed to decode a checkpoint without act-order and is left out, as in the literature.
        nbytes = sum(tensors[f"{layer.name}.{s}"].numel() * tensors[f"{layer.name}.{s}"].element_size()
                     for s in layer.storage)
        sizes[layer.name] = {**layer.settings, "shape": [n, k], "bits_per_weight": round(nbytes * 8 / (k * n), 4)}
    return sizes


def layer_backends(config: dict, tensors: dict, layers, codec) -> tuple:
    """(device, dtype, {layer: Backend}): what would run each quantized layer of a checkpoint loaded with
    load_quantized(device="auto") (this machine's GPU if it has one) and the default dtype, as kernels.dispatch.layer_backend decides it for the module each
    layer's codec builds."""
    device, dtype = resolve_device("auto"), checkpoint_dtype(config, tensors, layers)
    backends = {}
    for layer in layers:
        module = codec.build_module(layer, config["quantization_config"], dtype)  # on the meta device
        if isinstance(module, QuantLinear):  # its g_idx (act-order?) and scales' dtype are the files'
            g_idx = tensors.get(f"{layer.name}.g_idx")
            g_idx = group_index(layer.in_features, module.group_size) if g_idx is None else g_idx
            facts = grid_facts(layer.in_features, layer.out_features, module.bits, module.group_size, g_idx,
                               layer.scale_dtype)
        elif hasattr(module, "facts"):
            facts = module.facts()
        else:
            backends[layer.name] = Backend("-", f"{type(module).__name__} does not say what runs it")
            continue
        try:
            backends[layer.name] = layer_backend(facts, device, dtype)
        except ValueError as e:  # QUANTKIT_BACKEND names one that cannot run here
            backends[layer.name] = Backend("error", str(e))
    return device, dtype, backends


def inspect_checkpoint(path) -> dict:
    folder = Path(path)
    config, tensors, packed, codec = checkpoint.read_checkpoint(folder)
    qc = config["quantization_config"]
    layers = _layer_sizes(tensors, packed)
    device, dtype, backends = layer_backends(config, tensors, packed, codec)
    for name, backend in backends.items():
        layers[name].update(backend=backend.name, backend_reason=backend.reason)
    report = checkpoint.read_report(folder)
    for name, info in layers.items():
        stats = report["layers"].get(name, {}) if isinstance(report.get("layers"), dict) else {}
        info["method"] = stats.get("method", qc.get("meta", {}).get("method", "gptq"))
        info.update({k: stats[k] for k in ("error", "cosine", "sqnr_db") if k in stats})
        info["flagged"] = name in report.get("flagged", [])
    files = sorted(folder.glob("*.safetensors"))
    # what the run said of the weights it left in float and of its experts' calibration (quantkit.run.coverage)
    said = [part.get("summary") for part in (report.get("coverage"), report.get("experts")) if isinstance(part, dict)]
    return {"path": str(folder), "quantization_config": qc, "layers": layers,
            "total_bytes": sum(f.stat().st_size for f in files),
            "quantized_weights": sum(v["shape"][0] * v["shape"][1] for v in layers.values()),
            "runs_on": {"device": device, "dtype": str(dtype).removeprefix("torch.")},
            "notes": [line for line in said if isinstance(line, str)]}


def inspect_table(info: dict) -> str:
    rows = ["| layer | method | quantizer | bits | group | sym | rotation | bits/weight | rel. output error | cosine "
            "| SQNR dB | backend |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in info["layers"].items():
        rotation = (r.get("rotation") or {}).get("type", "none")
        mark = " **worse than its kind**" if r.get("flagged") else ""
        rows.append(f"| {name}{mark} | {r['method']} | {r['quantizer']} | {r['bits']} | {r['group_size']} | "
                    f"{r.get('sym', '-')} | {rotation} | {r['bits_per_weight']:.3f} | {_fmt(r.get('error'), '.3e')} | "
                    f"{_fmt(r.get('cosine'), '.6f')} | {_fmt(r.get('sqnr_db'), '.2f')} | {r.get('backend', '-')} |")
    rows.append(f"\n{len(info['layers'])} quantized linears, {info['quantized_weights']:,} weights; "
                f"checkpoint size {info['total_bytes'] / 2**20:.2f} MiB")
    rows += backend_lines(info)
    rows += info.get("notes", [])
    return "\n".join(rows)


def backend_lines(info: dict) -> list:
    """What runs the layers, by backend and reason (the JSON's per-layer backend and backend_reason, counted)."""
    runs_on = info.get("runs_on")
    counts = Counter((r["backend"], r["backend_reason"]) for r in info["layers"].values() if "backend" in r)
    if not runs_on or not counts:
        return []
    lines = [f"loaded here with load_quantized(device='auto') ({runs_on['device']}, {runs_on['dtype']}), layers run on:"]
    return lines + [f"  {name} ({n} layer{'s' * (n != 1)}): {reason}" for (name, reason), n in counts.most_common()]

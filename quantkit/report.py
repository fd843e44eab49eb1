"""What the CLI prints: the per-layer quantization table, inspect output, perplexity of a path."""
from pathlib import Path

from quantkit.formats import checkpoint
from quantkit.formats.output import REPORT_NAME


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def layer_table(report: dict) -> str:
    """Markdown table: per linear, bits/group, relative output error, damping, alpha, seconds."""
    rows = ["| layer | bits | group | rel. output error | damp | seconds |", "|---|---|---|---|---|---|"]
    for name, r in report["layers"].items():
        rows.append(f"| {name} | {r['bits']} | {r['group_size']} | {_fmt(r.get('error'), '.3e')} | "
                    f"{_fmt(r.get('damp'), 'g')} | {_fmt(r.get('seconds'), '.2f')} |")
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


def inspect_checkpoint(path) -> dict:
    folder = Path(path)
    config, tensors, packed, _ = checkpoint.read_checkpoint(folder)
    qc = config["quantization_config"]
    layers = _layer_sizes(tensors, packed)
    report_path = folder / REPORT_NAME
    report = checkpoint.read_json(report_path) if report_path.is_file() else {}
    for name, info in layers.items():
        stats = report.get("layers", {}).get(name, {})
        info["method"] = stats.get("method", qc.get("meta", {}).get("method", "gptq"))
        if "error" in stats:
            info["error"] = stats["error"]
    files = sorted(folder.glob("*.safetensors"))
    return {"path": str(folder), "quantization_config": qc, "layers": layers,
            "total_bytes": sum(f.stat().st_size for f in files),
            "quantized_weights": sum(v["shape"][0] * v["shape"][1] for v in layers.values())}


def inspect_table(info: dict) -> str:
    rows = ["| layer | method | quantizer | bits | group | sym | rotation | bits/weight | rel. output error |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in info["layers"].items():
        rotation = (r.get("rotation") or {}).get("type", "none")
        rows.append(f"| {name} | {r['method']} | {r['quantizer']} | {r['bits']} | {r['group_size']} | "
                    f"{r.get('sym', '-')} | {rotation} | {r['bits_per_weight']:.3f} | {_fmt(r.get('error'), '.3e')} |")
    rows.append(f"\n{len(info['layers'])} quantized linears, {info['quantized_weights']:,} weights; "
                f"checkpoint size {info['total_bytes'] / 2**20:.2f} MiB")
    return "\n".join(rows)

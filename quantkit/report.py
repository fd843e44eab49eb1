"""What the CLI prints: the per-layer quantization table, inspect output, perplexity of a path."""
from pathlib import Path

from quantkit.errors import QuantkitError
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
        # bits per weight counts qweight, qzeros and scales; g_idx (32 bits per input column) is not
        # needed to decode a checkpoint without act-order and is left out, as in the literature.
        nbytes = sum(tensors[f"{layer.name}.{s}"].numel() * tensors[f"{layer.name}.{s}"].element_size()
                     for s in ("qweight", "qzeros", "scales"))
        sizes[layer.name] = {"bits": layer.bits, "group_size": layer.group_size, "sym": layer.sym, "shape": [n, k],
                             "bits_per_weight": round(nbytes * 8 / (k * n), 4)}
    return sizes


def inspect_checkpoint(path) -> dict:
    folder = Path(path)
    config, tensors, packed = checkpoint.read_checkpoint(folder)
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
    rows = ["| layer | method | bits | group | sym | bits/weight | rel. output error |",
            "|---|---|---|---|---|---|---|"]
    for name, r in info["layers"].items():
        rows.append(f"| {name} | {r['method']} | {r['bits']} | {r['group_size']} | {r['sym']} | "
                    f"{r['bits_per_weight']:.3f} | {_fmt(r.get('error'), '.3e')} |")
    rows.append(f"\n{len(info['layers'])} quantized linears, {info['quantized_weights']:,} weights; "
                f"checkpoint size {info['total_bytes'] / 2**20:.2f} MiB")
    return "\n".join(rows)


def is_quantized_folder(path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.is_file() and "quantization_config" in checkpoint.read_json(cfg)


def load_any(path, device="auto", dtype=None):
    """(model, tokenizer) for a quantized folder or a floating-point model (folder or hub id)."""
    from transformers import AutoTokenizer

    from quantkit.api import resolve_device
    from quantkit.loading import load_quantized
    from quantkit.model.loader import load_fp_model

    device = resolve_device(device)
    if is_quantized_folder(path):
        model = load_quantized(path, device_map=device, dtype=dtype)
        try:
            return model, AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise QuantkitError(f"{path} has no usable tokenizer ({type(e).__name__}): copy the tokenizer files of "
                                "the source model into it") from e
    model, tokenizer = load_fp_model(path, dtype or ("float32" if device == "cpu" else "auto"))
    return model.to(device), tokenizer


def evaluate_path(path, dataset, seqlen, max_tokens=None, device="auto", dtype=None, progress=True) -> dict:
    from quantkit.data import eval_ids
    from quantkit.eval import perplexity

    model, tokenizer = load_any(path, device, dtype)
    ids = eval_ids(tokenizer, dataset, max_tokens)
    return perplexity(model, ids, seqlen, progress=progress)

"""What the CLI prints: the per-layer quantization table, inspect output, perplexity of a path."""
import json
from pathlib import Path

from quantkit.formats import checkpoint
from quantkit.formats.gptq import module_settings


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def layer_table(report: dict) -> str:
    """Markdown table: per linear, bits/group, relative output error, damping, alpha, seconds."""
    rows = ["| layer | bits | group | rel. output error | damp | seconds |", "|---|---|---|---|---|---|"]
    for name, r in report["layers"].items():
        rows.append(f"| {name} | {r['bits']} | {r['group_size']} | {_fmt(r.get('error'), '.3e')} | "
                    f"{_fmt(r.get('damp'), 'g')} | {_fmt(r.get('seconds'), '.2f')} |")
    return "\n".join(rows)


def _layer_sizes(tensors: dict, qc: dict) -> dict:
    layers = {}
    for key in tensors:
        if not key.endswith(".qweight"):
            continue
        name = key[: -len(".qweight")]
        bits, group_size, sym = module_settings(qc, name)
        k, n = tensors[f"{name}.g_idx"].numel(), tensors[f"{name}.scales"].shape[1]
        # bits per weight counts qweight, qzeros and scales; g_idx (32 bits per input column) is not
        # needed to decode a checkpoint without act-order and is left out, as in the literature.
        nbytes = sum(tensors[f"{name}.{s}"].numel() * tensors[f"{name}.{s}"].element_size()
                     for s in ("qweight", "qzeros", "scales"))
        layers[name] = {"bits": bits, "group_size": group_size, "sym": sym, "shape": [n, k],
                        "bits_per_weight": round(nbytes * 8 / (k * n), 4)}
    return layers


def inspect_checkpoint(path) -> dict:
    folder = Path(path)
    config = checkpoint.read_config(folder)
    qc = config["quantization_config"]
    tensors = checkpoint.read_tensors(folder)
    layers = _layer_sizes(tensors, qc)
    report_path = folder / "quantkit_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
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
    return cfg.is_file() and "quantization_config" in json.loads(cfg.read_text())


def load_any(path, device="auto", dtype=None):
    """(model, tokenizer) for a quantized folder or a floating-point model (folder or hub id)."""
    from transformers import AutoTokenizer

    from quantkit.api import resolve_device
    from quantkit.loading import load_quantized
    from quantkit.model.loader import load_fp_model

    device = resolve_device(device)
    if is_quantized_folder(path):
        return load_quantized(path, device_map=device, dtype=dtype), AutoTokenizer.from_pretrained(path)
    model, tokenizer = load_fp_model(path, dtype or ("float32" if device == "cpu" else "auto"))
    return model.to(device), tokenizer


def evaluate_path(path, dataset, seqlen, max_tokens=None, device="auto", dtype=None, progress=True) -> dict:
    from quantkit.data import eval_ids
    from quantkit.eval import perplexity

    model, tokenizer = load_any(path, device, dtype)
    ids = eval_ids(tokenizer, dataset, max_tokens)
    return perplexity(model, ids, seqlen, progress=progress)

#!/usr/bin/env python
"""docs/quality_smollm2.png from docs/quality_smollm2.json: the measured SmolLM2-135M rows of docs/QUALITY.md, in
three panels, one per protocol (their numbers are comparable within a panel, not across):

  1. quantkit's methods at group size 128: KL divergence from the fp model against bits per weight;
  2. GPTQ against llm-compressor (g64, the same calibration windows): perplexity, the one measure both have;
  3. GGUF files of the same per-tensor types, quantkit's and llama.cpp's: llama-perplexity's KL divergence
     against the file size (both tools' files of one type are the same size).

The script measures nothing: to change the picture, change the JSON (from a benchmark's table) and run it again.

    python scripts/plot_quality.py                      # rewrite docs/quality_smollm2.png
    python scripts/plot_quality.py --out /tmp/q.png

Needs matplotlib (not one of quantkit's dependencies: `pip install matplotlib`).
"""
import argparse
import json
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
DATA = DOCS / "quality_smollm2.json"
PNG = DOCS / "quality_smollm2.png"
# method -> (label, colour, marker); drawn in this order, one line through its bit widths
METHODS = {
    "rtn": ("RTN", "#9e9e9e", "o"), "awq": ("AWQ", "#8c6d31", "s"), "gptq": ("GPTQ", "#1f77b4", "o"),
    "awq+gptq": ("AWQ+GPTQ", "#17becf", "D"), "turboquant": ("TurboQuant (data-free)", "#f4a6a6", "v"),
    "e8": ("E8P (data-free)", "#c5b0d5", "^"), "turboquant+gptq": ("TurboQuant+GPTQ", "#d62728", "v"),
    "e8+gptq": ("E8P+GPTQ", "#9467bd", "^"),
}
GGUF = {  # quantizer -> (label, colour, marker, filled)
    "llama.cpp": ("llama.cpp", "#ff7f0e", "s", False), "llama.cpp imatrix": ("llama.cpp + imatrix", "#ff7f0e", "s", True),
    "quantkit rtn": ("quantkit RTN", "#1f77b4", "o", False), "quantkit gptq": ("quantkit GPTQ", "#1f77b4", "o", True),
}


def sets(path: Path) -> dict:
    return {s["id"]: s for s in json.loads(path.read_text())["sets"]}


def methods_panel(ax, rows):
    for method, (label, colour, marker) in METHODS.items():
        points = sorted((r["bpw"], r["kld"]) for r in rows
                        if r["run"].split(":")[0] == method and r["run"].split(":")[2] == "128")
        if points:
            ax.plot(*zip(*points), marker=marker, color=colour, label=label, linewidth=1.5)
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (codes, zeros and scales)")
    ax.set_ylabel("mean KL divergence from fp (nats/token)")
    ax.legend(fontsize=7, loc="upper right")


def peer_panel(ax, rows, fp_ppl):
    for tool, colour, marker in (("llm-compressor", "#2ca02c", "s"), ("quantkit", "#1f77b4", "o")):
        points = sorted((r["bpw"], r["ppl"]) for r in rows if r["tool"] == tool)
        ax.plot(*zip(*points), marker=marker, color=colour, label=f"{tool} GPTQ g64", linewidth=1.5)
        for x, y in points:
            ax.annotate(f"{y:g}", (x, y), textcoords="offset points", xytext=(6, -3), fontsize=7, color=colour)
    ax.axhline(fp_ppl, linestyle="--", color="black", linewidth=0.8, label=f"fp ({fp_ppl:g})")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (codes, zeros and scales)")
    ax.set_ylabel("perplexity (WikiText-2 test)")
    ax.legend(fontsize=7, loc="upper right")


def gguf_panel(ax, rows):
    for quantizer, (label, colour, marker, filled) in GGUF.items():
        points = [(r["mib"], r["kld"]) for r in rows if r["quantizer"] == quantizer]
        ax.scatter(*zip(*points), marker=marker, label=label, s=30, edgecolors=colour,
                   facecolors=colour if filled else "none")
    for kind in dict.fromkeys(r["type"] for r in rows):  # each type's calibrated pair joined, named at quantkit's
        pair = {r["quantizer"]: r for r in rows if r["type"] == kind}
        ours, theirs = pair["quantkit gptq"], pair["llama.cpp imatrix"]
        ax.plot([ours["mib"], theirs["mib"]], [ours["kld"], theirs["kld"]], color="#bbbbbb", linewidth=0.8, zorder=0)
        crowded = any(0 < ours["mib"] - r["mib"] < 2 and 0.8 < r["kld"] / ours["kld"] < 1.25 for r in rows)
        ax.annotate(kind, (ours["mib"], ours["kld"]), textcoords="offset points", xytext=(5 if crowded else -5, -3),
                    fontsize=7, ha="left" if crowded else "right")
    ax.set_xlim(min(r["mib"] for r in rows) - 4, max(r["mib"] for r in rows) + 2)
    ax.set_yscale("log")
    ax.set_xlabel("file size (MiB; token_embd F16 in every file)")
    ax.set_ylabel("mean KL divergence from F16 (llama-perplexity)")
    ax.legend(fontsize=7, loc="upper right")


def plot(data: Path, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("matplotlib is not installed (pip install matplotlib): docs/quality_smollm2.png not drawn")
    found = sets(data)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    methods_panel(axes[0], found["methods"]["rows"] + found["codebooks"]["rows"])
    peer_panel(axes[1], found["llm-compressor"]["rows"], found["llm-compressor"]["fp_ppl"])
    gguf_panel(axes[2], found["gguf"]["rows"])
    titles = (f"quantkit's methods ({found['methods']['date']}, {found['codebooks']['date']})",
              f"against llm-compressor ({found['llm-compressor']['date']})",
              f"GGUF against llama.cpp ({found['gguf']['date']})")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", linewidth=0.3)
    fig.suptitle("SmolLM2-135M-Instruct, lower is better (data: docs/quality_smollm2.json, from docs/QUALITY.md)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help="the measured rows (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=PNG, help="the PNG to write (default: %(default)s)")
    args = ap.parse_args(argv)
    plot(args.data, args.out)


if __name__ == "__main__":
    main()

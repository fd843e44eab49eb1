#!/usr/bin/env python
"""quantkit's GGUF files against llama.cpp's own quantizer, scored by llama.cpp's llama-perplexity, one table.

For each llama.cpp file type asked for, the same model is quantized four ways, every file with the same per-tensor
types (token_embd / output kept in F16 on both sides, so the sizes are equal up to metadata):
  llama.cpp           llama-quantize from llama.cpp's own F16 conversion (convert_hf_to_gguf.py); not for IQ2_XXS,
                      which llama-quantize refuses to make without an imatrix
  llama.cpp imatrix   the same with an importance matrix from --calib (llama-imatrix, --calib-chunks x 512 tokens)
  quantkit rtn        `quantkit quantize --method rtn --gguf-type TYPE` (llama.cpp's mix without imatrix)
  quantkit gptq       `quantkit quantize --method gptq --gguf-type TYPE` on --calib (the same text; the mix
                      llama.cpp makes with an imatrix)
  quantkit auto       with --auto: `--method gptq --gguf-type auto --target-bits B`, B the bits per weight of the
                      quantized linears in that mix (quantkit.gguf.mix, the types llama-quantize gives), so the file
                      is the same size or a little smaller: each tensor's type chosen by measured sensitivity
and scored on the first --chunks windows of 512 tokens of --eval: perplexity (llama-perplexity's, which scores the
second half of each window), mean KL divergence from the F16 model's token distributions and the share of tokens
whose top choice is the F16 model's (--kl-divergence against a base computed once from the F16 file).

llama.cpp is built from the llama-cpp-python sdist, which vendors its source and convert_hf_to_gguf.py; --build does
it (cached under --llama-cpp; the converter's Python needs the vendored gguf-py, numpy, sentencepiece, transformers,
torch: --converter-python). On a CPU with AMX, a native build (-DGGML_NATIVE=ON) can stop with "Illegal instruction"
where the OS does not grant AMX tiles: the build here names the x86 extensions and leaves AMX off.

    python scripts/bench_gguf.py ~/.cache/quantkit-assets/smollm2-135m --llama-cpp /work/llamacpp --build \\
        --converter-python /work/llamacpp/venv/bin/python --types Q4_0 Q4_K_M Q3_K_M Q2_K \\
        --calib ../shared/assets/text/wikitext2_tok_valid.txt --eval ../shared/assets/text/wikitext2_raw_test.txt
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from quantkit.gguf.auto import stored_bits
from quantkit.gguf.mix import FILE_TYPES, layer_types

X86 = ["AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX512_VBMI", "AVX_VNNI"]
TARGETS = ["llama-perplexity", "llama-quantize", "llama-imatrix", "llama-bench"]
NEEDS_IMATRIX = {"IQ2_XXS"}  # llama-quantize refuses these without an imatrix: no plain llama.cpp row


def run(cmd, log: Path | None = None) -> str:
    print("+", " ".join(map(str, cmd)), file=sys.stderr)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"{cmd[0]} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr


def llama_cpp_source(root: Path, build: bool) -> Path:
    """The vendored llama.cpp folder under root (downloaded and built with --build, once)."""
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found and build:
        root.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "llama-cpp-python",
             "-d", root])
        sdist = sorted(root.glob("llama_cpp_python-*.tar.gz"))[-1]
        run(["tar", "-xzf", sdist, "-C", root])
        found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        sys.exit(f"no llama.cpp source under {root}: pass --build to download and build it")
    src = found[-1]
    if build and not all((src / "build" / "bin" / t).is_file() for t in TARGETS):
        flags = [f"-DGGML_{x}=ON" for x in X86]
        run(["cmake", "-S", src, "-B", src / "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", *flags,
             "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
        run(["cmake", "--build", src / "build", "-j2", "--target", *TARGETS])
    return src


def scores(log: str) -> dict:
    """ppl, mean KLD, same-top-token % from llama-perplexity --kl-divergence output."""
    def number(pattern):
        m = re.search(pattern, log)
        return float(m.group(1)) if m else float("nan")
    return {"ppl": number(r"Mean PPL\(Q\)\s*:\s*([\d.]+)"), "kld": number(r"Mean\s+KLD:\s*([-\d.]+)"),
            "top": number(r"Same top p:\s*([\d.]+)")}


def mix_bits(model: Path, file_type: str) -> float:
    """The bits per weight of the quantized linears in llama.cpp's mix of `file_type` for this model (calibrated)."""
    from safetensors import safe_open

    config = json.loads((model / "config.json").read_text())
    shapes = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if re.match(r"model\.layers\.\d+\..*\.weight$", key) and len(f.get_slice(key).get_shape()) == 2:
                    out_features, in_features = f.get_slice(key).get_shape()
                    shapes[key[:-len(".weight")]] = (in_features, out_features)
    types = layer_types(file_type, shapes, config, calibrated=True)
    return sum(stored_bits(types[n], *shapes[n]) for n in shapes) / sum(a * b for a, b in shapes.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="folder holding (or to hold) the llama.cpp sdist")
    ap.add_argument("--build", action="store_true", help="download the sdist and build llama.cpp's tools if missing")
    ap.add_argument("--converter-python", default=sys.executable, help="Python that runs convert_hf_to_gguf.py")
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M", "Q3_K_M", "Q2_K"], choices=FILE_TYPES)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--eval", type=Path, required=True)
    ap.add_argument("--calib-chunks", type=int, default=128, help="512-token windows for imatrix and GPTQ")
    ap.add_argument("--chunks", type=int, default=64, help="512-token evaluation windows")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_gguf"))
    ap.add_argument("--auto", action="store_true", help="also --gguf-type auto at each file type's bits per weight")
    args = ap.parse_args()

    src, work = llama_cpp_source(args.llama_cpp, args.build), args.workdir
    work.mkdir(parents=True, exist_ok=True)
    bins, threads = src / "build" / "bin", ["-t", str(args.threads)]
    f16, imatrix, base = work / "f16.gguf", work / "imatrix.gguf", work / "f16.kld"
    if not f16.is_file():
        run([args.converter_python, src / "convert_hf_to_gguf.py", args.model, "--outfile", f16, "--outtype", "f16"])
    if not imatrix.is_file():
        run([bins / "llama-imatrix", "-m", f16, "-f", args.calib, "-c", 512, "--chunks", args.calib_chunks,
             "-o", imatrix, *threads])
    if not base.is_file():
        run([bins / "llama-perplexity", "-m", f16, "-f", args.eval, "-c", 512, "--chunks", args.chunks,
             "--kl-divergence-base", base, *threads])
    keep_f16 = ["--token-embedding-type", "f16", "--output-tensor-type", "f16"]
    rows = []
    for kind in args.types:
        files = {"llama.cpp": work / f"lcpp-{kind}.gguf", "llama.cpp imatrix": work / f"lcpp-{kind}-imatrix.gguf"}
        if kind in NEEDS_IMATRIX:
            del files["llama.cpp"]
        elif not files["llama.cpp"].is_file():
            run([bins / "llama-quantize", *keep_f16, f16, files["llama.cpp"], kind])
        if not files["llama.cpp imatrix"].is_file():
            run([bins / "llama-quantize", "--imatrix", imatrix, *keep_f16, f16, files["llama.cpp imatrix"], kind])
        for method in ("rtn", "gptq"):
            out = work / f"quantkit-{method}-{kind}"
            if not (out / "model.gguf").is_file():
                calib = ["--dataset", args.calib, "--nsamples", args.calib_chunks, "--seqlen", 512] * (method != "rtn")
                run(["quantkit", "quantize", args.model, "-o", out, "--method", method, "--gguf-type", kind, *calib,
                     "--overwrite"])
            files[f"quantkit {method}"] = out / "model.gguf"
        if args.auto:
            out = work / f"quantkit-auto-{kind}"
            if not (out / "model.gguf").is_file():
                run(["quantkit", "quantize", args.model, "-o", out, "--method", "gptq", "--gguf-type", "auto",
                     "--target-bits", f"{mix_bits(args.model, kind):.6f}", "--dataset", args.calib, "--nsamples",
                     args.calib_chunks, "--seqlen", 512, "--overwrite"])
            files["quantkit auto"] = out / "model.gguf"
        for name, path in files.items():
            log = run([bins / "llama-perplexity", "-m", path, "--kl-divergence-base", base, "--kl-divergence",
                       "-c", 512, "--chunks", args.chunks, *threads], work / f"{path.parent.name}-{path.stem}.log")
            rows.append((kind, name, path.stat().st_size, scores(log)))
    print(f"\n{args.model.name}: llama-perplexity on {args.chunks} x 512 tokens of {args.eval.name} "
          f"(second half of each window scored), KLD from the F16 GGUF\n")
    print("| type | quantizer | file MiB | ppl | mean KLD | same top % |\n|---|---|---|---|---|---|")
    for kind, name, size, s in rows:
        print(f"| {kind} | {name} | {size / 2**20:.2f} | {s['ppl']:.4f} | {s['kld']:.6f} | {s['top']:.2f} |")


if __name__ == "__main__":
    main()

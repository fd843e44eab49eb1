"""Instruction statistics of the GPTQ Triton kernels' inner loops, compiled offline (no GPU needed).

Compiles each autotune config of a launch kind for a real NVIDIA target (default sm_90, H100) with
the ptxas/cuobjdump that ship inside the triton wheel, finds the K loop (the longest backward
branch) in the SASS and counts its instructions per weight. This is how docs/BENCHMARKS.md reasons
about the kernels between GPU sessions: the M = 1 path is issue-bound, so instructions per weight
bound its bandwidth; shared-memory traffic (STS/LDS/BAR) in the loop means Triton inserted a layout
conversion; STL/LDL means register spills; I2F means the slow integer-to-float conversion is back.

    python scripts/sass_stats.py                      # every kind, every config, sm_90
    python scripts/sass_stats.py --kind m1 --arch 80  # M = 1 configs on A100
    python scripts/sass_stats.py --kind m1 --dump out/   # also write the SASS files
    python scripts/sass_stats.py --bits 3 --check     # fail on spills, layout conversions, I2F, no MMA

Int arguments are compiled as multiples of 16 (what Triton specialises on for real shapes such as
4096 or 14336); uniform groups (g128), symmetric v1 zeros, fp16, no bias; `--bits` picks the width.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from quantkit.kernels import triton_codebook, triton_dequant, triton_gptq, triton_rotation, triton_trellis  # noqa: E402
from quantkit.schemes.trellis import FAST_SETTING, Trellis  # noqa: E402
from quantkit.schemes.trellis_codes import CODES  # noqa: E402

KINDS = ("m1", "m1h2", "decode", "gemm", "dequant", "codebook", "cbdequant", "rotate", "trellis", "trellismm")
MATMULS = ("m1", "m1h2", "decode", "gemm")  # the GPTQ kernel's launch kinds
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"0x([0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
SHARED = ("STS", "LDS", "STSM", "LDSM", "BAR")
NO_TOOLS = 77  # exit status without ptxas/cuobjdump ("skipped", as test harnesses read it)
SPILLS = ("STL", "LDL")


def _tool(name):
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def tools_available():
    """True when the triton wheel carries the NVIDIA compiler tools this script needs."""
    return all(os.path.exists(_tool(n)) for n in ("ptxas", "cuobjdump"))


def compile_sass(fn, signature, constexprs, aligned, num_warps, num_stages, arch=90):
    """SASS text of `fn` compiled for sm_<arch>; `aligned` args get Triton's divisible-by-16 hint."""
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def _instructions(sass):
    """(address, instruction without its predicate) for every instruction in a cuobjdump listing."""
    return [(int(m.group(1), 16), _PREDICATE.sub("", m.group(2))) for m in map(_INSTR.match, sass.splitlines()) if m]


def main_loop(sass):
    """Instructions of the longest loop: the body of the longest branch back to a lower address."""
    instrs = _instructions(sass)
    best = []
    for addr, ins in instrs:
        target = _TARGET.search(ins) if ins.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            best = max(best, [i for a, i in instrs if int(target.group(1), 16) <= a <= addr], key=len)
    return best


def whole_kernel(sass):
    return [i for _, i in _instructions(sass) if not i.startswith(("NOP", "EXIT", "BRA"))]


def opcode_counts(instrs):
    return collections.Counter(i.split()[0].split(".")[0] for i in instrs)


def _matmul_launch(config, block_m, bits):
    sig = {n: "*fp16" for n in ("x_ptr", "s_ptr", "b_ptr", "y_ptr")}
    sig.update({n: "*i32" for n in ("qw_ptr", "qz_ptr", "g_ptr", "lock_ptr")}, ws_ptr="*fp32")
    ints = ("M", "N", "K", "KW", "NW", "GS", "stride_xm", "stride_ym", "SPLIT_K", "M_BUCKET", "NUM_SMS", "WAVES")
    sig.update({n: "i32" for n in ints})
    kw = config.kwargs
    const = dict(BITS=bits, ZERO_OFFSET=1, UNIFORM=True, HAS_BIAS=False, IS_FP16=True,
                 BLOCK_M=kw.get("BLOCK_M", block_m), BLOCK_N=kw["BLOCK_N"], BLOCK_K=kw["BLOCK_K"],
                 GROUP_M=kw["GROUP_M"], EVEN_K=True, EVEN_N=True, INTERPRETER=False, HALF2=kw.get("HALF2", False))
    aligned = [n for n in sig if n.endswith("_ptr")] + ["N", "K", "KW", "NW", "GS", "stride_xm", "stride_ym"]
    return triton_gptq.gptq_matmul_kernel, sig, const, aligned


def _dequant_launch(config, _, bits):
    sig = {"qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "g_ptr": "*i32", "w_ptr": "*fp16"}
    sig.update({n: "i32" for n in ("N", "K", "KW", "NW", "GS")})
    kw = config.kwargs
    const = dict(BITS=bits, ZERO_OFFSET=1, UNIFORM=True, IS_FP16=True, BLOCK_K=kw["BLOCK_K"], BLOCK_N=kw["BLOCK_N"],
                 EVEN_K=True, EVEN_N=True, INTERPRETER=False)
    return triton_dequant.gptq_dequant_kernel, sig, const, list(sig)


def _codebook_layer(variant):
    """The signature of a codebook layer's tensors and scalars, as both codebook kernels take them."""
    return {"c_ptr": "*i32", "s_ptr": "*fp16", "g_ptr": "*i32",
            "cb_ptr": "*i32" if variant == triton_codebook.E8P else "*fp32",  # E8P's int32 words, else float levels
            "N": "i32", "K": "i32", "KW": "i32", "GS": "i32", "OFFSET": "fp32", "RATIO": "fp32"}


def _codebook_launch(config, _, bits):
    kw = config.kwargs
    variant = triton_codebook.VARIANTS[kw["VARIANT"]]
    sig = {"x_ptr": "*fp16", "b_ptr": "*fp16", "y_ptr": "*fp16", "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32",
           "SPLIT_K": "i32", **_codebook_layer(variant)}
    const = dict(BITS=bits, DECODE=variant, UNIFORM=True, HAS_BIAS=False, IEEE=False, BY_CODE=kw["BY_CODE"],
                 BLOCK_M=kw["BLOCK_M"], BLOCK_N=kw["BLOCK_N"], BLOCK_K=kw["BLOCK_K"], INTERPRETER=False)
    return triton_codebook.codebook_kernel, sig, const, [n for n in sig if n.endswith("_ptr")] + ["N", "K", "KW", "GS"]


def _codebook_dequant_launch(config, _, bits):
    kw = config.kwargs
    variant = triton_codebook.VARIANTS[kw["VARIANT"]]
    sig = {"w_ptr": "*fp16", **_codebook_layer(variant)}
    const = dict(BITS=bits, DECODE=variant, UNIFORM=True, BLOCK_N=kw["BLOCK_N"], BLOCK_K=kw["BLOCK_K"],
                 INTERPRETER=False)
    return triton_codebook.codebook_dequant_kernel, sig, const, [n for n in sig if n.endswith("_ptr")] + ["N", "K"]


def _rotate_launch(config, _, bits):
    kw = config.kwargs
    sig = {"x_ptr": "*fp16", "s_ptr": "*fp32", "y_ptr": "*fp16", "M": "i32", "N": "i32", "scale": "fp32"}
    const = dict(B=kw["B"], LOG_B=kw["B"].bit_length() - 1, BLOCK_M=kw["BLOCK_M"])
    return triton_rotation.rotate_kernel, sig, const, ["x_ptr", "s_ptr", "y_ptr", "N"]


def _trellis_layer(kw, bits):
    """The constexprs both trellis kernels take for the default setting (L 16) or trellis-l12's (the width's step and
    code), and the config's lanes."""
    q = Trellis(bits, **({} if kw["L"] == 16 else FAST_SETTING))
    return dict(BITS=bits, L=kw["L"], V=q.step, CODE=CODES.index(q.code), Q=0, TILE_ROWS=q.tile_rows,
                WIDTH=q.length // q.tile_rows, BLOCK_J=kw["BLOCK_J"], BLOCK_N=kw["BLOCK_N"], INTERPRETER=False)


def _trellis_launch(config, _, bits):
    sig = {"codes_ptr": "*i32", "scales_ptr": "*fp16", "g_idx_ptr": "*i32", "table_ptr": "*fp32", "out_ptr": "*fp16",
           "N": "i32", "K": "i32", "KW": "i32"}
    const = _trellis_layer(config.kwargs, bits)
    return triton_trellis.trellis_dequant_kernel, sig, const, [n for n in sig if n.endswith("_ptr")] + ["N", "K", "KW"]


def _trellis_matmul_launch(config, _, bits):
    sig = {"x_ptr": "*fp16", "codes_ptr": "*i32", "scales_ptr": "*fp16", "g_idx_ptr": "*i32", "table_ptr": "*fp32",
           "b_ptr": "*fp16", "y_ptr": "*fp16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
           **{n: "i32" for n in ("M", "N", "K", "KW", "GROUP_SHIFT", "SPLIT_K")}}
    const = dict(_trellis_layer(config.kwargs, bits), UNIFORM=True, HAS_BIAS=False, IEEE=False,
                 BLOCK_M=config.kwargs["BLOCK_M"])
    return triton_trellis.trellis_matmul_kernel, sig, const, [n for n in sig if n.endswith("_ptr")] + ["N", "K", "KW"]


def _trellis_matmul_configs():
    """The fused kernel's lanes (triton_trellis.FUSED_LANES) at M = 1 and M <= 16, at L = 16 and 12."""
    bj, bn = triton_trellis.FUSED_LANES
    return [triton.Config(dict(BITS=b, L=L, BLOCK_M=bm, BLOCK_J=bj, BLOCK_N=bn), num_warps=4, num_stages=3)
            for b in (1, 2, 3, 4) for L in (12, 16) for bm in (1, triton_trellis.FUSED_MAX_M)]


def _trellis_configs():
    """The decode's lanes (triton_trellis.LANES) at each code width, at the default L = 16 and trellis-l12's 12."""
    bj, bn = triton_trellis.LANES
    return [triton.Config(dict(BITS=b, L=L, BLOCK_J=bj, BLOCK_N=bn), num_warps=4, num_stages=3)
            for b in (1, 2, 3, 4) for L in (12, 16)]


def _codebook_configs():
    """Each decode variant on triton_codebook's tiles (M <= 16 and above; for table levels and E8P also the tile by
    code position, which 4-bit levels and 2- and 4-bit E8P take); --bits picks the code width."""
    def tiles(variant):
        by_code = [False, True] if variant in ("table", "e8p") else [False]
        return [(b, triton_codebook.tile_for(m, b)) for b in by_code for m in ((1, 17) if not b else (1,))]
    return [triton.Config(dict(VARIANT=v, BY_CODE=b, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=3)
            for v in triton_codebook.VARIANTS for b, (bm, bn, bk, w) in tiles(v)]


def _codebook_dequant_configs():
    """Each decode variant on the prefill path's decode tile."""
    bk, bn = triton_codebook.DEQUANT_BLOCK_K, triton_codebook.DEQUANT_BLOCK_N
    return [triton.Config(dict(VARIANT=v, BLOCK_N=bn, BLOCK_K=bk), num_warps=4, num_stages=3)
            for v in triton_codebook.VARIANTS]


def _rotate_configs():
    """The tiles rotate_triton launches for many rows, from the smallest Hadamard block to the largest."""
    return [triton.Config(dict(B=b, BLOCK_M=bm), num_warps=w, num_stages=3)
            for b in (32, 128, 1024, 4096) for bm, w in [triton_rotation.tile_for(b, 1 << 16)]]


# kind -> (configs, how to build the launch, BLOCK_M fixed by the launch kind or None)
LAUNCHES = {
    "m1": (triton_gptq.M1_CONFIGS, _matmul_launch, 1),
    "m1h2": (triton_gptq.M1_HALF2_CONFIGS, _matmul_launch, 1),
    "decode": (triton_gptq.DECODE_CONFIGS, _matmul_launch, 16),
    "gemm": (triton_gptq.GEMM_CONFIGS, _matmul_launch, None),
    "dequant": (triton_dequant.DEQUANT_CONFIGS, _dequant_launch, None),
    "codebook": (_codebook_configs(), _codebook_launch, None),
    "cbdequant": (_codebook_dequant_configs(), _codebook_dequant_launch, None),
    "rotate": (_rotate_configs(), _rotate_launch, None),
    "trellis": (_trellis_configs(), _trellis_launch, None),
    "trellismm": (_trellis_matmul_configs(), _trellis_matmul_launch, None),
}


def unique_configs(kind, bits=4):
    """The kind's configs for `bits`, once per compiled variant (WAVES only changes the launch grid)."""
    seen = {}
    for c in LAUNCHES[kind][0]:
        if kind in MATMULS and not triton_gptq.fits_bits(c, bits):
            continue
        if kind.startswith("trellis") and c.kwargs["BITS"] != bits:
            continue
        if kind == "codebook" and c.kwargs["BY_CODE"] and not triton_codebook.takes_tiles_by_code(
                triton_codebook.VARIANTS[c.kwargs["VARIANT"]], bits):   # a tile these codes never take
            continue
        key = (tuple((k, v) for k, v in c.kwargs.items() if k != "WAVES"), c.num_warps, c.num_stages)
        seen.setdefault(key, c)
    return list(seen.values())


def tile_name(config):
    """The compiled variant in a few characters: its tile (BLOCK M x N x K, or the rotation's rows x block) and
    the codebook decode."""
    kw = config.kwargs
    if "B" in kw:
        return f"{kw['BLOCK_M']} x {kw['B']}"
    if "L" in kw:
        rows = f"M {kw['BLOCK_M']}, " if "BLOCK_M" in kw else ""
        return f"{rows}L {kw['L']}, {kw['BLOCK_J']} tile rows x {kw['BLOCK_N']} outputs"
    tile = f"{kw.get('BLOCK_M', '-')} x {kw['BLOCK_N']} x {kw['BLOCK_K']}"
    return f"{kw['VARIANT']} {tile}" if "VARIANT" in kw else tile


def loop_stats(kind, config, arch=90, bits=4, dump=None):
    """Counts for one config's K loop: instructions per weight and the opcodes that signal trouble."""
    _, build, block_m = LAUNCHES[kind]
    fn, sig, const, aligned = build(config, block_m, bits)
    sig = {**sig, **{k: "constexpr" for k in const}}
    sass = compile_sass(fn, sig, const, aligned, config.num_warps, config.num_stages, arch)
    name = f"{kind}_b{bits}_{tile_name(config).replace(' ', '')}_w{config.num_warps}"
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, name + f"_sm{arch}.sass"), "w") as f:
            f.write(sass)
    if kind == "rotate":   # no loop over K: per element, and the butterflies unroll into the whole kernel
        loop = whole_kernel(sass)
        per_thread = const["BLOCK_M"] * const["B"] / (32 * config.num_warps)
    elif kind == "trellis":  # no loop: each lane's walk along its tile row unrolled
        loop = whole_kernel(sass)
        per_thread = const["BLOCK_N"] * const["BLOCK_J"] * const["WIDTH"] / (32 * config.num_warps)
    elif kind == "trellismm":  # the K loop's trip: BLOCK_J tile rows of WIDTH weights per output, walked unrolled
        loop = main_loop(sass) or whole_kernel(sass)
        per_thread = const["BLOCK_N"] * const["BLOCK_J"] * const["WIDTH"] / (32 * config.num_warps)
    else:                  # the K loop (the dequantize kernels have none), weights per thread per trip
        loop = main_loop(sass) or whole_kernel(sass)
        per_thread = const["BLOCK_N"] * const["BLOCK_K"] / (32 * config.num_warps)
    ops = opcode_counts(loop)   # counted over what the instructions are
    return dict(name=name, block_m=const.get("BLOCK_M"), instructions=len(loop), weights_per_thread=per_thread,
                per_weight=len(loop) / per_thread, ldg=ops["LDG"], shared=sum(ops[o] for o in SHARED),
                spills=sum(ops[o] for o in SPILLS), i2f=ops["I2F"], mma=ops["HMMA"] + ops["HGMMA"])


def problems(kind, stats):
    """What --check rejects: spills anywhere; in the M = 1 FMA loop I2F, or shared-memory traffic that
    scales with the tile (a layout conversion of the decoded slabs: more than one shared-memory
    instruction per 4 weights a thread decodes; converting the tile's scale/zero row costs ~10-24);
    a tl.dot launch whose loop has no MMA instruction."""
    found = []
    if stats["spills"]:
        found.append(f"{stats['spills']} spill instructions")
    fma_loop = kind.startswith(("m1", "trellismm")) and stats["block_m"] == 1
    if fma_loop and stats["shared"] > stats["weights_per_thread"] / 4:
        found.append(f"{stats['shared']} shared-memory instructions (a layout conversion of the tile)")
    if fma_loop and stats["i2f"]:
        found.append(f"{stats['i2f']} I2F conversions")
    dot = kind in ("decode", "gemm", "codebook") or (kind.startswith(("m1", "trellismm")) and stats["block_m"] == 16)
    if dot and not stats["mma"]:
        found.append("no tensor-core MMA")
    return [f"{stats['name']}: {p}" for p in found]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=KINDS, nargs="+", default=list(KINDS),
                   help="launch kinds to compile (m1h2: the packed-fp16 M = 1 tiles, not yet autotuned)")
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100, 80: A100)")
    p.add_argument("--bits", type=int, choices=(2, 3, 4, 8), default=4,
                   help="code width (3-bit has no M = 1 shape: it runs the decode shape)")
    p.add_argument("--dump", help="folder to write each config's SASS into")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if a loop spills, the M = 1 loop converts layouts or uses I2F, or a tl.dot "
                        "launch has no MMA (the CI codegen test runs this)")
    args = p.parse_args()
    if not tools_available():
        print("error: this triton wheel has no NVIDIA ptxas/cuobjdump; install the standard triton wheel",
              file=sys.stderr)
        sys.exit(NO_TOOLS)
    print(f"K-loop SASS statistics, sm_{args.arch}, {args.bits}-bit g128 sym fp16 (triton {triton.__version__})\n")
    print("| kind | tile: BLOCK M x N x K (rotate: rows x block) | warps | stages | loop instr | weights/thread | instr/weight | LDG |"
          " shared mem ops | spills | I2F | MMA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    failures = []
    for kind in args.kind:
        if kind.startswith("m1") and args.bits == 3:   # no such launch: 3-bit M = 1 runs the decode shape
            continue
        # E8P's and the trellis's code widths
        if kind in ("codebook", "cbdequant", "trellis", "trellismm") and args.bits not in (2, 3, 4):
            continue
        for c in unique_configs(kind, args.bits):
            s = loop_stats(kind, c, args.arch, args.bits, args.dump)
            print(f"| {kind} | {tile_name(c)} | {c.num_warps} | "
                  f"{c.num_stages} | {s['instructions']} | {s['weights_per_thread']:.0f} | {s['per_weight']:.2f} | "
                  f"{s['ldg']} | {s['shared']} | {s['spills']} | {s['i2f']} | {s['mma']} |", flush=True)
            failures += problems(kind, s)
    if args.check and failures:
        sys.exit("check failed:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
    main()

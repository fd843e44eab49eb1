"""Benchmark scripts' own logic. The tinygemm baseline of scripts/bench_kernels.py computes the same layer as
quantkit's kernels: the GPTQ codes, scales and zeros converted for torch's INT4 kernel (its CPU variant here;
the CUDA one shares the scales-and-zeros layout, and bench_kernels.py --check compares it on the GPU).
scripts/bench_generate.py runs end to end on a tiny shape."""
import json
import os
import sys

from types import SimpleNamespace

import pytest
import torch

from quantkit.core import bitpack
from quantkit.kernels.reference import dequantize_weight

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
tinygemm = pytest.importorskip("tinygemm")


def _layer(n, k, group_size, zeros):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    return dict(qweight=bitpack.pack(codes, 4, dim=0), qzeros=bitpack.pack(zeros - 1, 4, dim=1),
                scales=(torch.rand(k // group_size, n, generator=g) * 0.01 + 0.001).half(),
                g_idx=(torch.arange(k) // group_size).to(torch.int32))


@pytest.mark.parametrize("sym", [True, False])
def test_tinygemm_decodes_the_gptq_layer(sym):
    n, k, group_size = 64, 256, 128
    groups = k // group_size
    zeros = (torch.full((groups, n), 8, dtype=torch.int32) if sym
             else torch.randint(1, 16, (groups, n), generator=torch.Generator().manual_seed(1), dtype=torch.int32))
    layer = _layer(n, k, group_size, zeros)
    w = dequantize_weight(layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], 4, k, 1,
                          dtype=torch.float32)  # W^T [K, N]
    packed, scales_and_zeros = tinygemm.from_gptq(layer["qweight"], layer["qzeros"], layer["scales"], 4, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = tinygemm.matmul(x, packed, scales_and_zeros, group_size)
    ref = x.float() @ w
    # bf16 scales and output: a few units of 2^-8; a wrong zero, nibble order or layout is off by O(1)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 4 * 2.0**-8


def test_tinygemm_refuses_other_bit_widths():
    layer = _layer(8, 128, 128, torch.full((1, 8), 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="4-bit"):
        tinygemm.from_gptq(layer["qweight"], layer["qzeros"], layer["scales"], 3, 128)


def test_bench_generate_runs_on_cpu(tmp_path, capsys):
    """The end-to-end benchmark builds, quantizes, loads and times both models (a tiny shape, CPU)."""
    bench_generate = pytest.importorskip("bench_generate")
    out = tmp_path / "rows.json"
    bench_generate.main(["--preset", "tiny", "--device", "cpu", "--workdir", str(tmp_path), "--batch", "1", "2",
                         "--prompt", "16", "--new", "3", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [("fp32", 1), ("fp32", 2), ("int4 g128", 1), ("int4 g128", 2)]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    assert "| int4 g128 | 2 |" in capsys.readouterr().out


def _text(tmp_path):
    """A small calibration/eval text file."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"the cat {i} sat on the mat and looked at the dog." for i in range(200)))
    return text


PEER_SHIM = """#!{python}
# Stands in for llm-compressor's Python: "quantizes" by copying the model, takes 5, 3, 4, ... seconds
import json, os, shutil, sys
from pathlib import Path
script, model, calib, out = sys.argv[1:5]
count = Path(os.environ["PEER_RUNS"])
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
shutil.copytree(model, out)
seconds = [5.0, 3.0, 4.0][n % 3]
Path(out, "timing.json").write_text(json.dumps({{"seconds": seconds, "oneshot_seconds": seconds - 1}}))
"""


def test_bench_peer_alternates_repeated_runs_and_keeps_the_fastest(tmp_path, capsys, monkeypatch):
    """--repeat 2: each tool runs twice per scheme (llm-compressor's runs shared by the schemes that only differ in
    quantkit's options), each in a process of its own, each model is evaluated once, and the table shows the fastest
    run of each and the ratio of each pair with their median."""
    bench_peer = pytest.importorskip("bench_peer")
    from quantkit.demo import bundled_model_path

    shim = tmp_path / "peer-python"
    shim.write_text(PEER_SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    monkeypatch.setenv("PEER_RUNS", str(tmp_path / "peer-runs"))
    text = _text(tmp_path)
    out = tmp_path / "rows.json"
    bench_peer.main([str(bundled_model_path()), "--peer-python", str(shim), "--calib", str(text), "--eval", str(text),
                     "--nsamples", "2", "--seqlen", "32", "--max-tokens", "256", "--runs", "gptq:4:32",
                     "gptq:4:32:one-pass", "--repeat", "2", "--json", str(out)])
    rows = {r["run"]: r for r in json.loads(out.read_text())}
    assert (tmp_path / "peer-runs").read_text() == "2"  # two runs of the one scheme, not four
    for run in ("gptq:4:32", "gptq:4:32:one-pass"):
        mine, peer = rows[run]["quantkit"], rows[run]["peer"]
        assert len(mine["times"]) == 2 and mine["seconds"] == min(mine["times"]) and mine["eval"] > 1
        assert peer["times"] == [5.0, 3.0] and peer["seconds"] == 3.0 and peer["eval"] > 1
        assert peer["oneshot"] == [4.0, 2.0]
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| gptq:4:32 |"))
    assert "its oneshot() s" in table and row.split(" | ")[-4:][0] == "3" and row.endswith("x) | 2 |")
    mine = rows["gptq:4:32"]["quantkit"]["times"]
    pairs = [f"{mine[0] / 5.0:.2f}", f"{mine[1] / 3.0:.2f}"]
    assert row.split(" | ")[-2] == f"{pairs[0]}, {pairs[1]} ({(mine[0] / 5.0 + mine[1] / 3.0) / 2:.2f}x)"



def test_bench_cpu_eval_times_both_product_paths(tmp_path, capsys, monkeypatch):
    """scripts/bench_cpu_eval.py: one row per model, both product paths timed, the same perplexity from each."""
    bench_cpu_eval = pytest.importorskip("bench_cpu_eval")
    from quantkit.core import matmul
    from quantkit.demo import bundled_model_path

    if not matmul.onednn_available():
        pytest.skip("oneDNN is used on CPUs with AVX-512 only")
    monkeypatch.setattr(matmul, "ENABLED", True)  # undone after the script has switched it
    bench_cpu_eval.main([str(bundled_model_path()), "--eval", str(_text(tmp_path)), "--max-tokens", "256",
                         "--seqlen", "64", "--repeat", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {bundled_model_path()}")]
    assert len(rows) == 1
    cells = rows[0].split(" | ")
    assert cells[1] == "4" and cells[4].endswith("x") and cells[5] == cells[6].rstrip(" |")


def test_gptq_error_sources_tables_one_layer(tmp_path, capsys):
    """scripts/gptq_error_sources.py: the layer's Hessian from the fp model, six GPTQ variants, the worst row's share;
    the range fit puts each group's dominant extreme exactly on its end code."""
    gptq_error_sources = pytest.importorskip("gptq_error_sources")
    from quantkit.demo import bundled_model_path

    text = _text(tmp_path)
    gptq_error_sources.main([str(bundled_model_path()), "model.layers.1.mlp.down_proj", "--calib", str(text),
                             "--nsamples", "2", "--seqlen", "32", "--bits", "3", "--group-size", "32"])
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| max-abs", "| range fit", "| quantkit"))]
    assert len(rows) == 6
    w = torch.tensor([[-0.8, 0.1, 0.3, 0.6], [0.9, -0.2, 0.0, 0.45]])
    grid = gptq_error_sources.RangeFitGrid(3, True)
    codes, dequant = grid.round(w, grid.fit(w))
    assert codes[0, 0] == 0 and codes[1, 0] == 7  # -4 and +3 steps: the dominant extremes
    assert torch.allclose(dequant[:, 0], w[:, 0], rtol=1e-3)


def test_rotation_layer_errors_tables_each_linear(tmp_path, capsys):
    """scripts/rotation_layer_errors.py: one row per linear of each chosen block, four errors each."""
    rotation_layer_errors = pytest.importorskip("rotation_layer_errors")
    from quantkit.demo import bundled_model_path

    rotation_layer_errors.main([str(bundled_model_path()), "--calib", str(_text(tmp_path)), "--nsamples", "2",
                                "--seqlen", "32", "--bits", "3", "--group-size", "32", "--blocks", "1,0"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 0.", "| 1."))]
    assert len(rows) == 14 and rows[0].startswith("| 0.") and rows[-1].startswith("| 1.")  # 7 linears a block
    assert all(len(row.split(" | ")) == 6 for row in rows)


def test_scale_rounding_modes_fit_one_scale_each():
    """scripts/scale_rounding.py: max-abs reproduces grid.fit's first candidate, range the range fit, nearest and up
    the max-abs scale rounded to fp16 either way; asymmetric grids keep quantkit's fit in every mode."""
    scale_rounding = pytest.importorskip("scale_rounding")
    from quantkit.schemes import grid as qgrid

    w = torch.randn(64, 32)
    w[:, 3] = w.abs().amax(dim=1) * 1.3
    g = qgrid.Grid(3, True)
    fit = {mode: scale_rounding.MODES[mode](3, True).fit(w)["scale"] for mode in scale_rounding.MODES}
    assert torch.equal(fit["choice"], g.fit(w)["scale"])
    assert torch.equal(fit["max-abs"], qgrid.fit(w, g)[0])
    assert torch.equal(fit["range"], qgrid.range_fit_scale(w, g))
    assert (fit["up"] >= fit["max-abs"]).all() and (fit["up"] > fit["max-abs"]).any()
    assert ((fit["nearest"] == fit["max-abs"]) | (fit["nearest"] == fit["up"])).all()
    for mode, cls in scale_rounding.MODES.items():
        asym = cls(3, False)
        assert torch.equal(asym.fit(w)["scale"], qgrid.Grid(3, False).fit(w)["scale"]), mode
        assert asym.name == "int"  # decoded, and written in the GPTQ layout, as the integer grid
    turboquant = scale_rounding.bench_quality.parse_run("turboquant:3:32")  # rounds with its own quantizer
    args = SimpleNamespace(nsamples=2, seqlen=32)
    assert scale_rounding.mode_config(scale_rounding.MaxAbsGrid)(turboquant, args).quantizer == "turboquant"


def test_scale_rounding_runs_bench_quality_with_the_mode_s_grid(tmp_path, capsys):
    """The mode's grid reaches each run through its --quantizer name: the max-abs fit gives another GPTQ model than
    quantkit's choice, in the same GPTQ layout (same size); an asymmetric grid's run is the same in both modes."""
    scale_rounding = pytest.importorskip("scale_rounding")
    from quantkit.demo import bundled_model_path
    from quantkit.schemes.base import SPEC_NAMES, SPEC_SUMMARIES

    text = _text(tmp_path)
    rows = {}
    try:
        for mode in ("choice", "max-abs"):
            out = tmp_path / f"{mode}.json"
            scale_rounding.main([mode, str(bundled_model_path()), "--calib", str(text), "--eval", str(text),
                                 "--nsamples", "2", "--seqlen", "32", "--max-tokens", "256", "--device", "cpu",
                                 "--runs", "gptq:3:32", "rtn:3:32:asym", "--json", str(out)])
            rows[mode] = {r["run"]: r for r in json.loads(out.read_text())}
    finally:  # the names it registered, so that other tests see quantkit's own
        for cls in scale_rounding.MODES.values():
            if cls is not scale_rounding.Grid:
                SPEC_NAMES.pop(cls.quantizer, None)
                SPEC_SUMMARIES.pop(cls.quantizer, None)
    assert "| gptq:3:32 |" in capsys.readouterr().out
    choice, max_abs = rows["choice"], rows["max-abs"]
    assert max_abs["gptq:3:32"]["ppl"] != choice["gptq:3:32"]["ppl"]
    assert (max_abs["gptq:3:32"]["bpw"], max_abs["gptq:3:32"]["mib"]) == (choice["gptq:3:32"]["bpw"],
                                                                          choice["gptq:3:32"]["mib"])
    assert max_abs["rtn:3:32:asym"]["ppl"] == choice["rtn:3:32:asym"]["ppl"]


def test_bench_quality_runs_name_their_options():
    """The run specs the docs' tables were made with (e.g. the act-order comparison in docs/QUALITY.md)."""
    bench_quality = pytest.importorskip("bench_quality")

    assert bench_quality.parse_run("gptq:3:128:no-act-order") == {"method": "gptq", "bits": 3, "group_size": 128,
                                                                  "act_order": False}
    assert bench_quality.parse_run("gptq:4:64:asym:hadamard") == {"method": "gptq", "bits": 4, "group_size": 64,
                                                                  "sym": False, "rotate": "hadamard"}
    with pytest.raises(SystemExit, match="unknown flag"):
        bench_quality.parse_run("gptq:4:64:act-order")


def test_bench_cpu_int4_times_one_layer_each_way(capsys):
    """scripts/bench_cpu_int4.py: its dense rows multiply the weight its packed layer holds; a row per shape and M;
    the op's row limit restored afterwards."""
    bench_cpu_int4 = pytest.importorskip("bench_cpu_int4")
    from quantkit.kernels import cpu_int4

    packed, weight = bench_cpu_int4.layer(256, 64)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(packed(x), x @ weight.float().t(), rtol=1e-2, atol=1e-2)  # weight rounded to bf16
    limit = cpu_int4.INT4_MM_MAX_M
    bench_cpu_int4.main(["--shapes", "128x64", "--rows", "1", "80", "--repeat", "1", "--threads", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 128 x 64 |")]
    assert [row.split(" | ")[1] for row in rows] == ["1", "80"]
    assert cpu_int4.INT4_MM_MAX_M == limit


def test_bench_cpu_codebook_checks_the_lookup_against_the_dequantize(capsys, monkeypatch):
    """scripts/bench_cpu_codebook.py: a row per quantizer and shape, exit 0 when the two decodes agree; a lookup
    that decodes differently fails the run."""
    bench = pytest.importorskip("bench_cpu_codebook")
    argv = ["--shapes", "64x32", "--quantizers", "turboquant3", "e8p4", "e8box3", "--group-size", "32",
            "--repeat", "1", "--threads", "1"]
    assert bench.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x 32" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| turboquant3", "| e8p4", "| e8box3"]
    assert "(none)" in rows[2]  # E8 at 3 bits: 24-bit points, no table
    from quantkit.kernels import codebook

    wrong = codebook.lookup_columns
    monkeypatch.setattr(codebook, "lookup_columns", lambda *a: wrong(*a).add_(1))
    assert bench.main(argv) == 1


def test_bench_cpu_codebook_checks_the_trellis_c_walk_against_its_torch_ops(capsys, monkeypatch):
    """The trellis rows: the dequantize as torch ops against its C walk; a walk that decodes differently fails."""
    bench = pytest.importorskip("bench_cpu_codebook")
    from quantkit.schemes import trellis, trellis_codes

    if trellis_codes.native_decode() is None:
        pytest.skip("the C decode could not be built here (no C compiler)")
    argv = ["--shapes", "128x64", "--quantizers", "trellis2", "--group-size", "32", "--repeat", "1", "--threads", "1"]
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("| trellis2 | 128 x 64 |") for line in lines) == 3  # the decode, then rows 1 and 4
    from quantkit.kernels import cpu_trellis

    product = cpu_trellis.trellis_linear  # the C product's table: a product that differs fails the run
    monkeypatch.setattr(cpu_trellis, "trellis_linear", lambda *a: None if (y := product(*a)) is None else -y)
    assert bench.main(argv) == (1 if cpu_trellis.native_gemv() is not None else 0)
    monkeypatch.setattr(cpu_trellis, "trellis_linear", product)
    walk = trellis.values_of_codes
    monkeypatch.setattr(trellis, "values_of_codes", lambda *a: None if (v := walk(*a)) is None else v.neg())
    assert bench.main(argv) == 1


@pytest.mark.parametrize("fmt", ["int4", "int4-asym", "int3", "int8", "int4-rotated", "turboquant4", "e8p2",
                                 "trellis3"])
def test_kernel_formats_compute_with_the_weight_they_report(fmt):
    """scripts/kernel_formats.py: each format's op (here its torch path) computes x Wᵀ with the dense weight the
    benchmark's check and fp16 baseline use (W rounded to fp16: 2^-11), after the rotation where there is one."""
    kernel_formats = pytest.importorskip("kernel_formats")
    layer = kernel_formats.build(fmt, 64, 256, 128, "cpu")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    ref = layer.reference(x)
    assert ((layer.op(x).double() - ref).norm() / ref.norm()).item() < 2.0**-10
    assert (layer.rotate is not None) == (fmt == "int4-rotated")
    assert (layer.tinygemm is not None) == (fmt in ("int4", "int4-asym"))


def test_bench_cpu_generate_runs_a_row_under_the_allocator_setting(tmp_path):
    """scripts/bench_cpu_generate.py: a row's child process loads the checkpoint, prefills and decodes, and reports
    its memory over the baseline and the glibc setting it ran under (--mmap-threshold reaches the child)."""
    bench = pytest.importorskip("bench_cpu_generate")
    from quantkit.api import quantize
    from quantkit.demo import bundled_model_path
    from quantkit.run.config import QuantConfig

    source = str(bundled_model_path())
    folder = tmp_path / "w4"
    quantize(source, folder, QuantConfig(method="rtn", bits=4, group_size=32), device="cpu")
    args = SimpleNamespace(source=source, threads=1, prompt=8, new_tokens=3, repeat=1, mmap_threshold=65536)
    row = bench.run_child(str(folder), "bfloat16", False, args)
    assert row["mmap_threshold"] == "65536"
    assert 0 < row["load"] <= row["peak"] and row["decode"] > 0 and row["prefill"] > 0
    params = sum(p.numel() for p in bench.skeleton(source).parameters())
    assert row["bf16_bytes"] == 2 * params
    assert bench.run_child(str(folder), "bfloat16", False, SimpleNamespace(**{**vars(args), "mmap_threshold": None})
                           )["mmap_threshold"] == "default (dynamic)"


def test_bench_load_memory_measures_each_row_in_a_fresh_process(tmp_path, capsys):
    """Build, quantize and the four children (imports, defaults, bf16, fp32) on a tiny shape."""
    bench_load_memory = pytest.importorskip("bench_load_memory")
    out = tmp_path / "rows.json"
    bench_load_memory.main(["--small", "--hidden", "128", "--layers", "1", "--intermediate", "256", "--heads", "4",
                            "--vocab", "512", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [rows[k]["dtype"] for k in ("defaults", "dtype=bfloat16", "dtype=float32")] == ["float16", "bfloat16",
                                                                                          "float32"]
    imports = rows[bench_load_memory.IMPORTS]["VmHWM"]
    assert all(r["VmHWM"] > imports > 0 for k, r in rows.items() if k != bench_load_memory.IMPORTS)
    assert "| defaults | float16 |" in capsys.readouterr().out and not (tmp_path / "work").exists()

"""QTIP's trellis-coded quantizer: the Viterbi search exact against brute force over every code sequence of short
trellises (free start, tail-biting, weighted), QTIP's tail-biting valid and near the optimum, decode(encode(x)) equal
to the search's reconstruction bit for bit, the rate exactly k bits per weight plus the scales, the computed codes
about N(0, 1), the quantizer through rtn and GPTQ's error feedback, and a checkpoint written, loaded and run."""
import itertools
import json
import subprocess
import sys

import pytest
import torch

from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.registry import method_names
from quantkit.algorithms.rtn import rtn
from quantkit.api import quantize
from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.schemes import trellis_codes as tc
from quantkit.schemes import trellis_viterbi as tv
from quantkit.schemes.base import make_quantizer, quantizer_for, quantizer_names
from quantkit.nn.decoded_linear import DecodedLinear
from quantkit.run.config import QuantConfig
from quantkit.schemes.trellis import Trellis
from test_quantizers import calibration, capture_results, loads_as_in_loop
from test_resume import assert_same_checkpoint, killed
from tiny_models import CONFIGS, _llama, make_model_folder

# (L, k, V, steps): short trellises whose every code sequence can be tried
SMALL = [(4, 1, 1, 8), (4, 2, 1, 5), (5, 1, 1, 9), (6, 2, 1, 4), (4, 1, 2, 4), (6, 1, 2, 5), (6, 3, 1, 3)]


def small_table(L, V, code="3inst"):
    return tc.values(code, L, V)


def path_cost(x, table, states, weights):
    return ((x - table[states]).pow(2) * weights).sum(dim=(-1, -2))


def brute_tail_biting(x, table, L, kV, weights):
    """Least cost over every symbol sequence of a tail-biting walk: [B]."""
    n = x.shape[1]
    symbols = torch.tensor(list(itertools.product(range(1 << kV), repeat=n)))       # [S, n]
    states = tc.states_of_symbols(symbols, L, kV)                                    # [S, n]
    return path_cost(x[:, None], table, states[None], weights[:, None]).min(dim=1).values


def brute_free_start(x, table, L, kV, weights):
    """Least cost over every first state and every symbol after it (no tail-biting): [B]."""
    n = x.shape[1]
    best = torch.full((x.shape[0],), float("inf"))
    for first in range(1 << L):
        for symbols in itertools.product(range(1 << kV), repeat=n - 1):
            states, s = [first], first
            for b in symbols:
                s = ((s << kV) | b) & ((1 << L) - 1)
                states.append(s)
            best = torch.minimum(best, path_cost(x, table, torch.tensor(states), weights))
    return best


@pytest.fixture(params=["c", "torch"])
def search_path(request, monkeypatch):
    """Runs a test on both searches: the C one (trellis_viterbi.c) and the torch one it must agree with."""
    if request.param == "torch":
        monkeypatch.setattr(tv, "native_search", lambda: None)
    elif tv.native_search() is None:
        pytest.skip("the C search could not be built here (no C compiler)")
    return request.param


def sample(B, n, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, n, V, generator=gen), torch.rand(B, n, V, generator=gen) + 0.1


@pytest.mark.parametrize("L,k,V,n", SMALL)
def test_exact_tail_biting_equals_brute_force(L, k, V, n, search_path):
    x, w = sample(5, n, V)
    table = small_table(L, V)
    states, cost = tv.tail_biting_exact(x, table, L, k * V, w)
    torch.testing.assert_close(cost, brute_tail_biting(x, table, L, k * V, w), rtol=1e-5, atol=1e-5)
    # the path is a tail-biting walk: its states are the ones its symbols decode to, and its cost is theirs
    assert torch.equal(tc.states_of_symbols(states & ((1 << k * V) - 1), L, k * V), states)
    torch.testing.assert_close(path_cost(x, table, states, w), cost, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L,k,V,n", [(4, 1, 1, 6), (4, 2, 1, 4), (5, 1, 2, 4), (6, 1, 1, 5)])
def test_free_start_viterbi_equals_brute_force(L, k, V, n, search_path):
    x, w = sample(4, n, V, seed=1)
    table = small_table(L, V, "1mad")
    states, cost = tv.viterbi(x, table, L, k * V, w)
    torch.testing.assert_close(cost, brute_free_start(x, table, L, k * V, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(path_cost(x, table, states, w), cost, rtol=1e-5, atol=1e-5)
    kv_mask = (1 << L) - 1
    assert torch.equal(((states[:, :-1] << k * V) & kv_mask) | (states[:, 1:] & ((1 << k * V) - 1)), states[:, 1:])


@pytest.mark.parametrize("L,k,V,n", SMALL)
def test_qtip_tail_biting_is_a_valid_walk_no_better_than_the_optimum(L, k, V, n, search_path):
    x, w = sample(8, n, V, seed=2)
    table = small_table(L, V)
    states, cost = tv.tail_biting(x, table, L, k * V, w)
    assert torch.equal(tc.states_of_symbols(states & ((1 << k * V) - 1), L, k * V), states)
    torch.testing.assert_close(path_cost(x, table, states, w), cost, rtol=1e-5, atol=1e-5)
    assert bool((cost >= tv.tail_biting_exact(x, table, L, k * V, w)[1] - 1e-5).all())


def test_qtip_tail_biting_is_near_the_optimum_on_long_sequences():
    x, _ = sample(64, 64, 1, seed=3)
    table = tc.values("1mad", 8, 1)
    approx = tv.tail_biting(x, table, 8, 2)[1].sum()
    exact = tv.tail_biting_exact(x, table, 8, 2)[1].sum()
    assert exact <= approx <= 1.01 * exact


def test_tiles_are_read_row_by_row():
    q = Trellis(2, state_bits=8, length=16, tile_rows=2)                 # tiles of 2 rows x 8 columns
    t = torch.arange(4 * 16).reshape(4, 16)
    seqs = q.sequences(t)
    assert q.width == 8 and seqs.shape == (4, 16)
    assert seqs[1].tolist() == list(range(8, 16)) + list(range(24, 32))  # rows 0-1, columns 8-15
    assert torch.equal(q.unsequence(seqs, t.shape), t)
    with pytest.raises(QuantkitError, match="tiles of 2 rows"):
        q.sequences(t[:3])


def test_chunked_search_equals_one_chunk(monkeypatch):
    monkeypatch.setattr(tv, "native_search", lambda: None)  # the torch search's chunks
    x, w = sample(40, 16, 2, seed=4)
    table = tc.values("3inst", 8, 2)
    whole = tv.tail_biting(x, table, 8, 4, w)
    monkeypatch.setitem(tv.CHUNK_ELEMENTS, "cpu", 7 << 8)  # 7 sequences per chunk, the last one short
    parts = tv.tail_biting(x, table, 8, 4, w)
    assert torch.equal(whole[0], parts[0])


@pytest.mark.parametrize("L,k,V,n", [(12, 2, 1, 32), (12, 3, 1, 64), (12, 2, 2, 32), (9, 4, 2, 8)])
@pytest.mark.parametrize("B,threads", [(40, 1), (40, 2), (5, 3)])
def test_c_search_agrees_with_the_torch_search(L, k, V, n, B, threads, monkeypatch):
    """40 sequences: three groups of 16 lanes, the last one padded, one after another or side by side; 5 sequences:
    one group whose steps three threads split (where a step has enough states). Free, start-constrained and
    tail-biting searches. Near-ties may pick other paths: each path's cost is its own, and the costs agree."""
    if tv.native_search() is None:
        pytest.skip("the C search could not be built here (no C compiler)")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x, w = sample(B, n, V, seed=5)
    table = tc.values("1mad" if V == 1 else "3inst", L, V)
    overlap = torch.randint(0, 1 << (L - k * V), (B,), generator=torch.Generator().manual_seed(6))
    runs = {"free": lambda: tv.viterbi(x, table, L, k * V, w),
            "bound": lambda: tv.viterbi(x, table, L, k * V, w, start=overlap, end=overlap),
            "tail-biting": lambda: tv.tail_biting(x, table, L, k * V, w)}
    c = {name: run() for name, run in runs.items()}
    monkeypatch.setattr(tv, "native_search", lambda: None)
    for name, run in runs.items():
        states, cost = c[name]
        torch.testing.assert_close(cost, run()[1], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(path_cost(x, table, states, w), cost, rtol=1e-5, atol=1e-4)
    assert torch.equal(c["bound"][0][:, 0] >> k * V, overlap)
    assert torch.equal(c["bound"][0][:, -1] & ((1 << (L - k * V)) - 1), overlap)


@pytest.mark.parametrize("code,V", [("1mad", 1), ("3inst", 1), ("1mad", 2), ("3inst", 2)])
def test_computed_codes_are_about_unit_gaussians(code, V):
    v = tc.values(code, 16, V)
    assert v.shape == (1 << 16, V) and v.dtype == torch.float32
    assert float(v.mean().abs()) < 0.02 and abs(float(v.var()) - 1) < 0.03
    # a Gaussian's shape, not just its moments: the quartiles sit near ±0.674
    q = torch.quantile(v.reshape(-1)[::4], torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(q, torch.tensor([-0.674, 0.674]), atol=0.08, rtol=0)


def test_code_definitions():
    # 1MAD of state 0: the LCG gives 76625530 = 0x0491_367A, bytes 4 + 145 + 54 + 122 = 325
    assert float(tc.values("1mad", 4, 1)[0, 0]) == pytest.approx((325 - 510) / 147.800537109375)
    # 3INST of state 0: 64248484 = 0x03D4_5AA4 -> AND 0x8FFF8FFF = 0x03D4_0AA4 -> XOR 0x3B603B60 = 0x38B4_31C4
    halves = torch.tensor([0x38B4, 0x31C4], dtype=torch.int16).view(torch.float16)
    expected = (halves[0] + halves[1]).float() * tc.THREE_INST_GAIN
    assert float(tc.values("3inst", 4, 1)[0, 0]) == float(expected)
    table = torch.tensor(tc.sunflower_table(9))
    v = tc.values("hyb", 12, 2, table=table)
    assert v.shape == (4096, 2) and abs(float(table.pow(2).mean()) - 1) < 0.02
    assert set(v[:, 1].tolist()) <= set(table[:, 1].tolist())  # second coordinate from the table, never flipped


@pytest.mark.parametrize("settings", [
    dict(bits=2), dict(bits=3, step=1, code="1mad"), dict(bits=1, state_bits=8, step=2, code="3inst", length=32, tile_rows=1),
    dict(bits=4, state_bits=10, step=1), dict(bits=2, state_bits=10, code="hyb"), dict(bits=3, scale="refit"),
    dict(bits=2, state_bits=10, length=64, tile_rows=4)])
def test_decode_of_the_codes_is_the_search_reconstruction_and_the_rate_is_exact(settings):
    q = make_quantizer("trellis", **settings)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(q.tile_rows, 64, generator=gen)  # whole tiles, whole words of codes
    group = 2 * q.width
    res = rtn(w, q, group)
    codes, dequantized = q.round(w[:, :group], {"scale": res.params["scale"][:, 0]})
    assert torch.equal(codes.to(torch.int32), res.codes[:, :group])
    assert torch.equal(res.decoded()[:, :group], dequantized)             # decode(encode(x)), bit for bit
    assert int(res.codes.min()) >= 0 and int(res.codes.max()) < 1 << q.bits
    # what is stored: k bits per column, packed and unpacked, decodes the same; one fp16 scale per row and group
    words = bitpack.pack(res.codes.t(), q.code_bits, dim=0)
    back = bitpack.unpack(words, q.code_bits, w.shape[1], dim=0).t()
    assert torch.equal(q.dequantize(back, {"scale": res.params["scale"].repeat_interleave(group, dim=1)}),
                       res.decoded())
    assert words.numel() * 32 == w.numel() * q.bits                       # k·T bits per sequence, no more
    assert torch.equal(res.params["scale"], res.params["scale"].half().float())
    assert res.bits_per_weight() == q.bits + 16 / group
    assert make_quantizer("trellis", **q.settings()) == q


@pytest.mark.parametrize("settings", [
    dict(bits=2), dict(bits=3), dict(bits=4), dict(bits=2, state_bits=12, length=64, tile_rows=32),
    dict(bits=3, length=256, tile_rows=16), dict(bits=3, length=64, tile_rows=64), dict(bits=2, code="hyb"),
    dict(bits=2, step=1, code="3inst", state_bits=12, length=192, tile_rows=64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_decode_is_the_torch_decode(settings, threads, monkeypatch):
    """trellis_decode.c walks each tile (tiles 1, 3, 4 and 16 columns wide; the codes read in place through a
    transposed view, as the layer's packed layout gives them); the torch decode gathers every state's window."""
    if tc.native_decode() is None:
        pytest.skip("the C decode could not be built here (no C compiler)")
    q = make_quantizer("trellis", **settings)
    gen = torch.Generator().manual_seed(threads)
    codes = torch.randint(0, 1 << q.bits, (3 * q.width * 4, 4 * q.tile_rows), generator=gen, dtype=torch.int32).t()
    scale = torch.rand(codes.shape, generator=gen)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    native = q.dequantize(codes, {"scale": scale})
    with pytest.raises(QuantkitError, match="does not split"):  # checked before the C reads a partial tile
        q.dequantize(codes[1:], {"scale": scale[1:]})
    monkeypatch.setattr(tc, "native_decode", lambda: None)
    assert torch.equal(native, q.dequantize(codes, {"scale": scale}))


def test_gaussian_distortion_is_trellis_like():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(64, 512, generator=gen)
    mse = {b: float((rtn(w, quantizer_for("trellis", b, True, 128), 128).decoded() - w).pow(2).mean())
           for b in (2, 3)}
    assert mse[2] < 0.079 and mse[3] < 0.0215  # Lloyd-Max 0.1175 / 0.0345; E8P about 0.090 at 2 bits


@pytest.mark.parametrize("act_order,tiles", [(False, False), (True, False), (False, True)])
def test_gptq_rounds_whole_sequences_with_weighted_search(act_order, tiles):
    gen = torch.Generator().manual_seed(7)
    W = torch.randn(64, 192, generator=gen)
    X = torch.randn(1024, 192, generator=gen) @ torch.randn(192, 192, generator=gen) * 0.2
    q = Trellis(2, length=256, tile_rows=16) if tiles else quantizer_for("trellis", 2, True, -1)
    g = GPTQ(W)
    g.add_batch(X)
    res = g.quantize(q, group_size=-1, keep_dequant=True, act_order=act_order)
    assert torch.equal(res.decoded(), g.dequant)
    err = lambda Wq: float(torch.trace((W - Wq) @ g.H @ (W - Wq).t()))  # noqa: E731
    assert err(res.decoded()) < err(rtn(W, q, -1).decoded())


def test_settings_are_checked():
    assert "trellis" in quantizer_names() and {"trellis", "trellis+gptq"} <= set(method_names())
    with pytest.raises(QuantkitError, match="multiple of 4"):
        quantizer_for("trellis", 2, True, 34)
    with pytest.raises(QuantkitError, match="multiple of 2"):
        quantizer_for("trellis-l12", 2, True, 35)
    with pytest.raises(QuantkitError, match="multiple of 16"):
        quantizer_for("trellis-l16", 2, True, 72)
    with pytest.raises(QuantkitError, match="bits"):
        Trellis(5)
    with pytest.raises(QuantkitError, match="state_bits"):
        Trellis(4, state_bits=8, step=2)         # no more than kV = 8 bits of state
    with pytest.raises(QuantkitError, match="hyb"):
        Trellis(2, step=1, code="hyb")
    with pytest.raises(QuantkitError, match="table"):
        Trellis(2, code="3inst", table=((0.0, 0.0),))
    for bad in (((0.0, 0.0),), [[0.0], [1.0, 2.0]] * 256, "sunflower"):
        with pytest.raises(QuantkitError, match="pairs"):
            Trellis(2, code="hyb", table=bad)
    with pytest.raises(QuantkitError, match="sequence"):
        Trellis(2, state_bits=12, length=4, tile_rows=1)
    with pytest.raises(QuantkitError, match="unknown"):
        Trellis(2, code="lut")
    # the bit width's step and code by default, recorded in the settings
    assert (Trellis(2).step, Trellis(2).code, Trellis(4).step, Trellis(4).code) == (2, "3inst", 1, "1mad")
    assert Trellis(4).settings()["step"] == 1


@pytest.mark.parametrize("method", ["trellis+gptq"])
def test_writes_loads_and_gives_the_in_loop_logits(tmp_path, monkeypatch, method):
    # output widths of whole 64-row tiles: k and v 2 heads of 32 (the shared tiny models' are 32 wide)
    monkeypatch.setitem(CONFIGS, "llama-128x128", lambda: _llama(kv_heads=2, hidden=128, intermediate=128))
    src = make_model_folder("llama-128x128", tmp_path)
    results = capture_results(monkeypatch)
    quantize(str(src), tmp_path / "q", QuantConfig(method=method, bits=2, group_size=64, nsamples=4, seqlen=32),
             device="cpu", calibration_ids=calibration())
    layer = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["layers"][
        "model.layers.0.mlp.down_proj"]
    assert layer["quantizer"] == "trellis" and layer["state_bits"] == 16 and layer["tile_rows"] == 64
    assert layer["rotation"]["type"] == "hadamard"
    model = loads_as_in_loop(tmp_path / "q", src, results, calibration()[:2])
    assert isinstance(model.model.layers[0].mlp.down_proj, DecodedLinear)


def test_tiles_of_rows_are_checked_before_any_work():
    """The default tiles are 64 rows: a layer of 96 outputs is refused by the shape check the pipeline runs first."""
    from quantkit.core.groups import check_shape

    check_shape(Trellis(2), 128, 128, rows=128)
    with pytest.raises(QuantkitError, match="tiles of 64 rows"):
        check_shape(Trellis(2), 128, 128, rows=96)


def test_a_killed_trellis_run_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    """SIGKILL after block 0 of a trellis+gptq run, then --resume: the checkpoint an uninterrupted run writes, byte
    for byte (the search is deterministic, and resumed blocks see the replayed inputs bit for bit). Every run is a
    process of its own: the C and the torch searches round near-ties differently, and in the whole suite's process the
    search was once seen to run as torch ops (why is open) while the killed child ran the C one."""
    monkeypatch.setitem(CONFIGS, "llama-128x128", lambda: _llama(kv_heads=2, hidden=128, intermediate=128, layers=3))
    src = make_model_folder("llama-128x128", tmp_path)
    (tmp_path / "calib.txt").write_text("\n".join(f"A quiet river number {i} ran past the old mill and the green "
                                                   "hills every morning." for i in range(20)))

    def args(out, *extra):
        return ["quantize", src, "-o", out, "--method", "trellis+gptq", "--bits", 2, "--group-size", 64,
                "--dataset", tmp_path / "calib.txt", "--nsamples", 2, "--seqlen", 16, "--max-shard-size", "20KB",
                *extra]

    def child(*argv):  # each run in a fresh process, as the killed one is
        done = subprocess.run([sys.executable, "-c", "import sys; from quantkit.cli import main; main(sys.argv[1:])",
                               *[str(a) for a in argv]], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout + done.stderr

    ref, out = tmp_path / "ref", tmp_path / "out"
    child(*args(ref))
    killed((tmp_path, src), out, "block-00000", [str(a) for a in args(out)])
    assert "block 0 of 3 is done" in child(*args(out, "--resume"))
    assert_same_checkpoint(ref, out)


def test_qtips_setting_is_a_quantizer_the_trellis_methods_take(tmp_path, monkeypatch):
    """--quantizer trellis-l16: L = 16 on 16 x 16 tiles, recorded as trellis with its settings, loaded back as the
    quantizer wrote it; the trellis methods take no other quantizer."""
    # one small block: the search at L = 16 costs ~1 s per 10,000 weights here
    monkeypatch.setitem(CONFIGS, "llama-32x64", lambda: _llama(kv_heads=2, hidden=32, intermediate=64, layers=1))
    src = make_model_folder("llama-32x64", tmp_path)
    results = capture_results(monkeypatch)
    quantize(str(src), tmp_path / "q", QuantConfig(method="trellis", quantizer="trellis-l16", bits=2, group_size=64),
             device="cpu")
    layer = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["layers"][
        "model.layers.0.self_attn.k_proj"]
    assert (layer["quantizer"], layer["state_bits"], layer["length"], layer["tile_rows"]) == ("trellis", 16, 256, 16)
    loads_as_in_loop(tmp_path / "q", src, results, calibration()[:2])
    with pytest.raises(QuantkitError, match="rounds with the trellis quantizer, not e8"):
        QuantConfig(method="trellis", quantizer="e8", bits=2)

"""Packed CPU inference (issue 40): torch's int4 layout read back exactly, CpuInt4Linear and the strip-wise decodes
against the reference decode, and load_quantized keeping every quantized weight packed on the CPU."""
import gc
import mmap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import quantkit
from quantkit.checkpoint import reads
from quantkit.core import bitpack, strips
from quantkit.core.errors import QuantkitError
from quantkit.kernels import cpu_int4
from quantkit.kernels.reference import gptq_linear_torch
from quantkit.nn import cpu_int4_linear
from quantkit.nn.cpu_int4_linear import CpuInt4Linear
from quantkit.nn.decoded_linear import DecodedLinear
from quantkit.nn.quant_linear import QuantLinear

FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def quant_linear(k, n, bits, group_size, fmt="gptq", act_order=False, seed=0) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    m = QuantLinear(k, n, bits, group_size, bias=True, checkpoint_format=fmt, dtype=torch.float32)
    groups = m.scales.shape[0]
    offset = 1 if fmt == "gptq" else 0
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen)
    m.qweight.copy_(bitpack.pack(torch.randint(0, 2**bits, (k, n), generator=gen), bits, dim=0))
    m.qzeros.copy_(bitpack.pack((zeros - offset) & (2**bits - 1), bits, dim=1))
    m.scales.copy_((torch.rand(groups, n, generator=gen) * 0.01 + 1e-3).half())
    g_idx = torch.arange(k) // (k if group_size == -1 else group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    m.g_idx.copy_(g_idx.to(torch.int32))
    m.bias.copy_(torch.randn(n, generator=gen))
    return m


def reference(m: QuantLinear, x):
    return gptq_linear_torch(x.float(), m.qweight, m.qzeros, m.scales, m.g_idx, m.bits, m.in_features, m.bias,
                             m.zero_offset())


@pytest.mark.parametrize("n", [64, 80, 176, 48, 16])
def test_the_kernel_layout_reads_back_exactly(n):
    """Whole blocks of 64 (or 32) outputs and the narrower last block, in every strip split."""
    codes = torch.randint(0, 16, (n, 96), generator=torch.Generator().manual_seed(n))
    packed = cpu_int4.pack(codes)
    assert packed.shape == (n, 48)
    unit = torch.ones(1, n), torch.zeros(1, n, dtype=torch.uint8)  # scale 1, zero 0: the codes themselves
    for strip in (1, 64, 1000):
        decoded = [cpu_int4.decode_columns(packed.unsqueeze(0), *unit, 96, a, b) for a, b in cpu_int4.blocks(n, strip)]
        assert torch.equal(torch.cat(decoded, dim=1), codes.t().float())


@pytest.mark.parametrize("k, bits, group_size, act_order, fmt", [
    (256, 4, 64, False, "gptq"), (256, 4, 128, True, "gptq_v2"), (256, 3, 32, False, "gptq"),
    (256, 2, 32, True, "gptq"), (256, 8, 128, False, "gptq"), (256, 8, 32, True, "gptq_v2"),
    (192, 4, 128, False, "gptq"), (192, 8, 128, True, "gptq"), (256, 4, -1, False, "gptq"),
    (200, 4, 64, False, "gptq"), (200, 4, 128, True, "gptq")])
def test_cpu_int4_linear_computes_the_reference_decode(k, bits, group_size, act_order, fmt):
    """Every bit width, act-order, both zero conventions; a short last group, run in the op's groups of 64 (192
    inputs at group 128) or padded to whole groups (200 inputs); one group per row, in the op's groups of 256."""
    m = quant_linear(k, 80, bits, group_size, fmt, act_order)
    packed = CpuInt4Linear.from_quant_linear(m)
    assert packed is not None and len(packed.planes) == (2 if bits == 8 else 1)
    assert packed.planes.shape[2] * 2 == (k if k % 32 == 0 else 256)  # padded only where K is no multiple of 32
    x = torch.randn(3, 7, k, generator=torch.Generator().manual_seed(1))
    # float32 activations (and bf16 past INT4_MM_MAX_M rows) decode exactly: float32's summation order only
    torch.testing.assert_close(packed(x), reference(m, x), **FP32_TOL)
    xb = x[:1, :2].to(torch.bfloat16)  # 2 rows: torch's int4 GEMM, whose weights are bf16-rounded
    ref = reference(m, xb)
    y = packed(xb)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).norm() / ref.norm()).item() < 4 * 2.0**-8  # a wrong plane or zero is off by O(1)


@pytest.mark.parametrize("k, group_size, slow_bf16", [(200, 64, True), (192, 128, True), (192, 128, False)])
def test_the_strip_decode_of_bf16_activations_rounds_the_weights_once(monkeypatch, k, group_size, slow_bf16):
    """Past INT4_MM_MAX_M rows, bf16 activations take the strip decode: each strip rounded to bf16, multiplied in bf16
    (or, where torch's CPU bf16 GEMM is slow, in float32), the result rounded to bf16; that is the reference decode's
    bf16 weight, up to the sum order. Padded inputs (200) and a short last group decoded as one (192 at group 128)."""
    m = quant_linear(k, 176, 4, group_size)
    packed = CpuInt4Linear.from_quant_linear(m)
    monkeypatch.setattr(strips, "STRIP_ELEMENTS", 64 * k)  # strips of 64 outputs: three
    monkeypatch.setattr(strips, "_slow_on_cpu", lambda dtype: slow_bf16)
    monkeypatch.setattr(cpu_int4, "INT4_MM_MAX_M", 0)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    w_t = reference(m, torch.eye(k)) - m.bias  # the exact decode, [K, N]
    want = (x.float() @ w_t.to(torch.bfloat16).float()).to(torch.bfloat16) + m.bias.to(torch.bfloat16)
    got = packed(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2.0**-8, atol=2.0**-7)  # a bf16 ulp or two: the sum order


@pytest.mark.parametrize("k, n, group_size", [(256, 40, 64), (256, 64, 16), (200, 64, -1)])
def test_layers_the_kernel_cannot_take_stay_quant_linears(k, n, group_size):
    """N % 16, group sizes no op group divides: 16, one group per row of 200 (no multiple of 32, wider than 256)."""
    assert CpuInt4Linear.from_quant_linear(quant_linear(k, n, 4, group_size)) is None


def test_strips_cover_every_output_exactly(monkeypatch):
    """Many narrow strips (the zeros of 3-bit codes are packed 32 outputs at a time) give the one-strip result."""
    m = quant_linear(128, 176, 3, 32)
    packed = CpuInt4Linear.from_quant_linear(quant_linear(128, 176, 4, 32))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    whole = m(x), packed(x)
    monkeypatch.setattr(strips, "STRIP_ELEMENTS", 40 * 128)
    assert len(strips.ranges(176, 128, 32)) == 6
    narrow = m(x), packed(x)
    for a, b in zip(whole, narrow):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(narrow[0], reference(m, x), **FP32_TOL)


@pytest.mark.parametrize("bits, act_order", [(4, False), (8, True)])
def test_the_repack_strip_by_strip_is_the_whole_layers(monkeypatch, bits, act_order):
    """Packed a few outputs at a time (on the op's block edges, a narrower last block included), the planes are the
    ones the whole layer packs to."""
    m = quant_linear(128, 176, bits, 32, "gptq", act_order)
    whole = CpuInt4Linear.from_quant_linear(m).planes
    monkeypatch.setattr(cpu_int4_linear, "REPACK_CODES", 40 * 128)
    assert len(cpu_int4.blocks(176, 40)) > 2
    assert torch.equal(CpuInt4Linear.from_quant_linear(m).planes, whole)


def test_a_layer_repacked_for_other_activations_builds_the_ops_scales_at_its_first_bf16_call():
    """Loaded for float32 or float16, a layer never runs the int4 GEMM until bf16 comes: its scales for the op are not
    held until then (a traced graph computes them inline), and are then those a bf16 repack builds."""
    m = quant_linear(128, 64, 4, 32)
    packed, eager = CpuInt4Linear.from_quant_linear(m, torch.float32), CpuInt4Linear.from_quant_linear(m)
    assert packed.kernel_scales is None and eager.kernel_scales is not None
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(packed(x), eager(x), rtol=0, atol=0)
    assert packed.kernel_scales is None
    compiled = torch.compile(packed, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x.bfloat16()), eager(x.bfloat16())) and packed.kernel_scales is None
    assert torch.equal(packed(x.bfloat16()), eager(x.bfloat16()))
    assert torch.equal(packed.kernel_scales, eager.kernel_scales)


def test_a_repacked_layer_stays_on_the_cpu():
    packed = CpuInt4Linear.from_quant_linear(quant_linear(128, 64, 4, 32))
    packed.to(torch.bfloat16)  # a dtype change is fine
    with pytest.raises(QuantkitError, match="device_map='cuda'"):
        packed.to("meta")


@pytest.mark.parametrize("method, bits", [("rtn", 4), ("rtn", 8), ("turboquant", 4)])
def test_load_quantized_keeps_the_weights_packed_on_the_cpu(model_factory, tmp_path, method, bits):
    src = model_factory("llama-gqa")
    quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(method=method, bits=bits, group_size=32),
                      device="cpu")
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    packed = quantkit.load_quantized(tmp_path / "q", device="cpu")
    cached = quantkit.load_quantized(tmp_path / "q", cache_dequantized=True, device="cpu")
    kinds = {type(m) for m in packed.modules()}
    assert (CpuInt4Linear if method == "rtn" else DecodedLinear) in kinds
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, cached(ids).logits, **FP32_TOL)
        assert not any("_weight_cache" in m.__dict__ for m in packed.modules())  # no dense copy was kept
        assert any("_weight_cache" in m.__dict__ for m in cached.modules())
        bf16 = quantkit.load_quantized(tmp_path / "q", dtype=torch.bfloat16, device="cpu")
        out = bf16.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 16)


def test_a_loaded_model_maps_no_more_of_its_files_than_the_input_embedding(model_factory, tmp_path):
    """Every tensor is read into memory of its own, but an input embedding stored in the load's dtype, which stays in
    the file, mapped alone (only the rows looked up become resident). Any other map would keep every page read
    through it so far resident for the model's lifetime."""
    if not Path("/proc/self/maps").is_file():
        pytest.skip("needs Linux's /proc")
    quantkit.quantize(str(model_factory("llama-gqa")), tmp_path / "q", quantkit.QuantConfig(bits=4, group_size=32),
                      device="cpu")  # float tensors stored in float32
    weights = tmp_path / "q" / "model.safetensors"
    for kwargs in ({"dtype": torch.bfloat16}, {"dtype": torch.float16, "cache_dequantized": True}, {}):
        model = quantkit.load_quantized(tmp_path / "q", **kwargs, device="cpu")
        gc.collect()
        embedding = model.get_input_embeddings().weight.nbytes
        mapped = mapped_bytes(weights)
        assert (mapped > 0) == (kwargs == {}), kwargs
        assert mapped <= embedding + 2 * mmap.ALLOCATIONGRANULARITY  # the embedding's own bytes, no whole-file map
        del model
    gc.collect()
    assert mapped_bytes(weights) == 0


def mapped_bytes(path) -> int:
    """Bytes of the address space that map `path` (0 where nothing does)."""
    spans = [line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines()
             if line.endswith(str(path))]
    return sum(int(b, 16) - int(a, 16) for a, b in spans)


def test_the_tensor_reader_maps_a_tensors_own_bytes(tmp_path):
    """A mapped tensor is the stored one, its map spans its own bytes (from the page they start in) and no other
    tensor's, a write to it stays in memory (copy-on-write), and the map goes with the last tensor that uses it."""
    if not Path("/proc/self/maps").is_file():
        pytest.skip("needs Linux's /proc")
    gen = torch.Generator().manual_seed(0)
    tensors = {"before": torch.randn(40_000, generator=gen), "emb": torch.randn(3000, 64, generator=gen).bfloat16(),
               "after": torch.randn(40_000, generator=gen), "empty": torch.zeros(0, 3)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    on_disk = path.read_bytes()
    reader = reads.TensorReader([path])
    emb = reader.map("emb")
    assert emb.dtype == torch.bfloat16 and torch.equal(emb, tensors["emb"])
    assert emb.nbytes < mapped_bytes(path) <= emb.nbytes + 2 * mmap.ALLOCATIONGRANULARITY
    emb[0] = 7
    assert path.read_bytes() == on_disk
    assert reader.map("empty").shape == (0, 3)
    del emb
    gc.collect()
    assert mapped_bytes(path) == 0


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
def test_the_tensor_reader_reads_what_safetensors_reads(tmp_path, monkeypatch, dtype):
    """Every stored dtype, a scalar and an empty tensor, in chunks that end inside a tensor; converted on the way
    where a float dtype is asked for, as Tensor.to converts."""
    monkeypatch.setattr(reads, "CHUNK_BYTES", 40)
    gen = torch.Generator().manual_seed(0)
    tensors = {"f16": torch.randn(7, 9, generator=gen).half(), "bf16": torch.randn(33, generator=gen).bfloat16(),
               "f32": torch.randn(3, 5, 2, generator=gen), "i32": torch.randint(-9, 9, (11,), dtype=torch.int32),
               "u8": torch.randint(0, 255, (5, 13), dtype=torch.uint8), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "t.safetensors")
    reader = reads.TensorReader([tmp_path / "t.safetensors"])
    for name, t in tensors.items():
        want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        got = reader.read(name, dtype if t.is_floating_point() else None)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    (tmp_path / "t.safetensors").write_bytes((tmp_path / "t.safetensors").read_bytes()[:-8])
    with pytest.raises(QuantkitError, match="truncated"):
        reads.TensorReader([tmp_path / "t.safetensors"]).read("u8")  # the file's last tensor

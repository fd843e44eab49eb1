"""Streaming quantization (issue 17): one block held at a time, checkpoints byte-identical to the in-memory writer."""
import torch
from safetensors.torch import save_file

from quantkit.api import quantize
from tiny_models import model_tensors
from quantkit.run.precheck import quantizable_linears
from quantkit.run.config import QuantConfig
from quantkit.checkpoint import files as checkpoint, codecs, shards
from quantkit.algorithms.method import Method
from quantkit.core.folders import drop_shared
from quantkit.models import stream
from quantkit.models.arch import arch_for
from quantkit.models.hub import load_fp_model


def test_header_matches_safetensors_for_every_dtype(tmp_path):
    tensors = {f"t{i}.{dt}": torch.zeros(i + 1, 3, dtype=dt) for i, dt in enumerate(shards._NAMES)}
    tensors["a.empty"] = torch.zeros(0, 2, dtype=torch.float16)
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    entries = [(n, shards.dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
    head, _ = shards.header_bytes(entries, {"format": "pt"})
    assert (tmp_path / "ref.safetensors").read_bytes()[:len(head)] == head
    tensors = {n: torch.randn(t.shape).to(t.dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    shards.write_file(tmp_path / "ours.safetensors", tensors, {"format": "pt"})  # what the part files are
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def in_memory_checkpoint(src, folder, config):
    """What quantkit wrote before streaming: the whole model loaded, one state dict, write_tensors."""
    model, _ = load_fp_model(str(src), "float32")
    arch = arch_for(model)
    method = Method(config, arch)
    results = {n: method.quantize(n, None, model.get_submodule(n)) for n in quantizable_linears(model, arch)}
    state = {k: v.to(torch.float32) for k, v in drop_shared(model.state_dict()).items()}
    codec = codecs.codec_for(results, config.checkpoint_format)
    folder.mkdir()
    checkpoint.write_tensors(folder, model_tensors(state, results, codec, config),
                             checkpoint.parse_size(config.max_shard_size))


def test_streamed_shards_are_byte_identical_to_the_in_memory_writer(model_factory, tmp_path):
    src = model_factory("llama")
    config = QuantConfig(method="rtn", group_size=32, max_shard_size="40KB")
    quantize(str(src), tmp_path / "streamed", config, device="cpu")
    in_memory_checkpoint(src, tmp_path / "ref", config)
    ref = sorted(p.name for p in (tmp_path / "ref").glob("model*"))
    assert len(ref) > 3 and ref == sorted(p.name for p in (tmp_path / "streamed").glob("model*"))
    for name in ref:
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name


def test_at_most_one_block_is_loaded_at_a_time(model_factory, tmp_path, monkeypatch):
    peak = []
    load = stream.StreamedModel.load

    def counting(self, prefix, **kwargs):
        module = load(self, prefix, **kwargs)
        blocks = self.model.get_submodule("model.layers")
        peak.append(sum(any(not p.is_meta for p in b.parameters()) for b in blocks))
        return module

    monkeypatch.setattr(stream.StreamedModel, "load", counting)
    calib = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    for method in ("rtn", "gptq"):
        peak.clear()
        quantize(str(model_factory("llama")), tmp_path / method, QuantConfig(method=method, group_size=32,
                 nsamples=2, seqlen=16), device="cpu", calibration_ids=calib)
        assert peak and max(peak) == 1, (method, peak)


def test_data_free_methods_hold_one_linear_weight_at_a_time(model_factory, tmp_path, monkeypatch):
    held = []
    load_names = stream.StreamedModel.load_names

    def counting(self, names):
        load_names(self, names)
        linears = [n for n in self.names if n.startswith("model.layers.") and n.endswith("proj.weight")]
        held.append(sum(not stream._get(self.model, n).is_meta for n in linears))

    monkeypatch.setattr(stream.StreamedModel, "load_names", counting)
    quantize(str(model_factory("llama")), tmp_path / "q", QuantConfig(method="rtn", group_size=32), device="cpu")
    assert held and max(held) == 1, held

"""A fixed sample of the families transformers ships, one of every kind the full sweep (scripts/family_sweep.py,
docs/MODELS.md) covers: each built tiny from its own config class by the sweep's generic shrinking, quantized with
rtn and gptq, loaded back, run; and what the run says it quantized and kept in float checked against an
independent count from the files it wrote."""
import json
import os
import re
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

import quantkit
from quantkit.models.hub import model_class

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
family_sweep = pytest.importorskip("family_sweep")

SAMPLE = [
    "llama",             # the dense baseline
    "qwen3_next",        # Gated DeltaNet + attention, MoE with a shared expert behind a sigmoid gate
    "qwen3_5",           # a hybrid vision-language model
    "qwen3_5_moe",       # the same with experts
    "lfm2",              # short convolutions interleaved with attention
    "nemotron_h",        # Mamba-2, ungated experts, attention
    "falcon_h1",         # attention and Mamba in parallel in every block
    "gemma4_text",       # per-layer inputs, sliding and full attention
    "deepseek_v32",      # MLA with an indexer whose weight the attention reads
    "deepseek_v4",       # hyper-connections, hash routing, renamed tensors
    "kimi_linear",       # linear attention with renamed SSM parameters
    "hunyuan_v1_moe",    # a router named wg
    "ernie4_5_moe",      # expert statics
    "glm_moe_dsa",       # blocks that hand their top-k indices to the next
    "falcon",            # linears that multiply with weight.T
    "gpt2",              # Conv1D
    "jetmoe",            # experts in a module of its own, F.linear(x, W[e]) each (split by quantkit.models.sliced)
    "inkling_text",      # shared experts as one batched product, bmm(x, W.transpose(1, 2))
    "dbrx",              # experts as 2-D tensors, every expert's rows stacked (quantkit.models.moe STACKED_GLU)
    "emu3",              # a text config (Emu3TextConfig) no auto class maps: its causal-LM class found by config_class
    "idefics3",          # a forward that asks its .device (the first parameter: the vision tower's) before block 0
    "kosmos-2.5",        # a decoder that reads segment_emb.weight.device before calling segment_emb
    "modernbert-decoder",  # get_decoder() is its output linear (named decoder), not the decoder
]
# tensors transformers merges as it loads and quantkit writes merged (load_quantized reads them; transformers'
# from_pretrained looks for the release's names): Kimi-Linear's q/k/v_conv1d are one conv1d in the model
WRITTEN_MERGED = {"kimi_linear": re.compile(r"\.[qkv]_conv1d\.weight$")}
EXPERT = re.compile(r"\.\d+(\.\w+)?$")  # a split expert's layer: what follows the fused tensor or module
BLOCK = re.compile(r"^(.*?\.)?(layers|h|blocks)\.\d+\.")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("sample"), {}

    def make(family):
        if family not in made:
            made[family] = family_sweep.build_tiny(family, root / family)
        return made[family]

    return make


def file_tensors(folder) -> dict:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({k: f.get_slice(k) for k in f.keys()})
    return out


def accounting(src, out) -> tuple[set, set, set]:
    """From the files alone: (packed layers, float weights of two or more dims inside decoder blocks, source tensors
    the output lacks that are neither a packed layer's weight or bias nor fused experts written as one layer per
    expert: `<experts>.<e>.<proj>` (quantkit.models.moe) or `<weight>.<e>` (quantkit.models.sliced))."""
    written, source = file_tensors(out), file_tensors(src)
    packed = {n.rpartition(".")[0] for n in written if n.endswith((".qweight", ".weight_packed", ".codes"))}
    floats = {n for n, t in written.items() if BLOCK.match(n) and n.rpartition(".")[0] not in packed
              and t.get_dtype() in ("F32", "F16", "BF16") and len(t.get_shape()) >= 2}
    split = {EXPERT.sub("", n) for n in packed if EXPERT.search(n)}
    kept = tuple(f"{x}." for x in packed | split)  # a tensor under a packed layer or a split experts module
    lost = {n for n in source if n not in written and n not in split and not n.startswith(kept)}
    return packed, floats, lost


def block_share(report, out, linear_floats) -> float:
    """Packed elements over the decoder blocks' linear weights (the packed ones and those kept in float)."""
    written = file_tensors(out)
    packed = sum(layer["shape"][0] * layer["shape"][1] for layer in report["layers"].values())
    kept = sum(torch.Size(written[n].get_shape()).numel() for n in linear_floats)
    return packed / (packed + kept)


@pytest.mark.parametrize("family", SAMPLE)
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_every_sampled_family_quantizes_loads_runs_and_says_what_it_kept(built, tmp_path, family, method):
    src = built(family)
    calibration = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    report = quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(method=method, group_size=32),
                               calibration_ids=calibration if method == "gptq" else None)
    packed, floats, lost = accounting(src, tmp_path / "q")
    coverage = report["coverage"]
    assert packed == set(report["layers"]), "the report names every packed layer, and only those"
    said = {n for kind, names in coverage.items() if isinstance(names, list) for n in names}
    assert floats <= said, f"kept in float without a word: {sorted(floats - said)[:3]}"
    merged = WRITTEN_MERGED.get(family)
    lost = {n for n in lost if not (merged and merged.search(n))}
    assert not lost, f"dropped: {sorted(lost)[:3]}"
    linear_floats = {n for kind in ("router", "read", "unused", "recipe") for n in coverage.get(kind, [])} & floats
    share = block_share(report, tmp_path / "q", linear_floats)
    assert share >= 0.95, f"{share:.3f} of the block linear weights packed: {coverage['summary']}"
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    with torch.inference_mode():
        logits = model(calibration[:1]).logits
    assert torch.isfinite(logits).all()
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["bits"] == 4


# families whose blocks keep linears in float by what the model's forward does with them: {family: (coverage kind,
# the float weights of that kind, from the tiny model's config)}
KEPT_BY_USE = {
    # the cross-attention layers run only beside an image: a text forward skips them, so they are never calibrated
    "mllama": ("unused", lambda config: re.compile(
        rf"\.layers\.({'|'.join(str(i) for i in config['cross_attention_layers'])})\.")),
    # RWKV's forward divides attention.output and feed_forward.value weights in place at its first eval call
    "rwkv": ("read", lambda config: re.compile(r"\.(attention\.output|feed_forward\.value)\.weight$")),
    # one attention block tied into every hybrid layer: each block is calibrated and written alone
    "zamba": ("shared", lambda config: re.compile(r"\.shared_transf\.(self_attn|feed_forward)\.")),
}


@pytest.mark.parametrize("family", sorted(KEPT_BY_USE))
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_linears_the_model_forward_needs_in_float_stay_there_and_the_model_runs_as_its_source(built, tmp_path, family,
                                                                                              method):
    src = built(family)
    calibration = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    report = quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(method=method, group_size=32),
                               calibration_ids=calibration if method == "gptq" else None)
    packed, floats, lost = accounting(src, tmp_path / "q")
    kind, which = KEPT_BY_USE[family]
    pattern = which(json.loads((src / "config.json").read_text()))
    assert packed and not lost
    expected = {n for n in floats if pattern.search(n)}
    assert expected and set(report["coverage"].get(kind, [])) >= expected
    assert not {n for n in packed if pattern.search(f"{n}.weight")}
    reference = model_class(AutoConfig.from_pretrained(src)).from_pretrained(src, dtype=torch.float32).eval()
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    with torch.inference_mode():
        ref, logits = reference(calibration[:1]).logits, model(calibration[:1]).logits
    assert torch.isfinite(logits).all()
    assert (logits - ref).norm() / ref.norm() < 0.3


def test_a_config_registered_under_another_model_type_gets_its_own_class():
    # transformers registers EvollaConfig under the model type "EvollaModel": the auto mappings' `in` misses it
    assert model_class(family_sweep.tiny_config("evolla")).cls.__name__ == "EvollaForProteinText2Text"


def test_stacked_experts_split_compute_what_the_fused_ones_did():
    from transformers import AutoModelForCausalLM

    from quantkit.models.moe import FlatExperts, split_experts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_sweep.tiny_config("dbrx"), dtype=torch.float32).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        split_experts(model)
        after = model(ids).logits
    assert any(isinstance(m, FlatExperts) for m in model.modules())
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)

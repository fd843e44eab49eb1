"""Fused experts no layout describes, split by what their own forward does (quantkit.models.sliced)."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from quantkit.core.errors import QuantkitError
from quantkit.models.sliced import ExpertSlices, split_in_files, split_sliced
from quantkit.models.uses import UseTrace


class RoutedExperts(nn.Module):
    """LongCat-Flash's shape: routed experts multiplied one at a time, F.linear(x, W[e]) (the index a 0-d tensor, as
    transformers' loops give it), identity experts past them, a norm after each routed expert."""

    def __init__(self, n=3, identity=1, hidden=16, inter=8):
        super().__init__()
        self.n = n
        self.gate_up_proj = nn.Parameter(torch.randn(n + identity, 2 * inter, hidden) / 4)  # identity rows unused
        self.down_proj = nn.Parameter(torch.randn(n, hidden, inter) / 4)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, index):
        out = torch.zeros_like(x)
        for e in index.unique():
            rows = (index == e).nonzero()[:, 0]
            if e >= self.n:
                out[rows] = x[rows]
                continue
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[rows] = self.norm(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return out


class SharedExperts(nn.Module):
    """Inkling's shape: every expert on every token in one batched product with W.transpose(1, 2)."""

    def __init__(self, n=2, hidden=16, inter=8):
        super().__init__()
        self.up = nn.Parameter(torch.randn(n, inter, hidden) / 4)
        self.down = nn.Parameter(torch.randn(n, hidden, inter) / 4)

    def forward(self, x, index):
        x = x.unsqueeze(0).expand(self.up.shape[0], -1, -1)
        return torch.bmm(F.gelu(torch.bmm(x, self.up.transpose(1, 2))), self.down.transpose(1, 2)).sum(0)


class Mixed(nn.Module):
    """A 3-D weight multiplied whole (an einsum over experts): not one expert at a time."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 16, 16))

    def forward(self, x, index):
        return torch.einsum("th,eoh->to", x, self.w)


def kinds(module, x, index):
    with torch.no_grad(), UseTrace(module) as trace:
        module(x, index)
    result = trace.result()
    return result.kinds, result.linears


@pytest.mark.parametrize("make", [RoutedExperts, SharedExperts])
def test_split_experts_compute_what_the_fused_module_did_and_trace_as_linears(make):
    torch.manual_seed(0)
    module, x, index = make(), torch.randn(12, 16), torch.randint(0, 4, (12,))
    with torch.no_grad():
        before = module(x, index)
    found, _ = kinds(module, x, index)
    weights = sorted(n for n, k in found.items() if k == "sliced")
    assert weights == sorted(n for n, p in module.named_parameters() if p.dim() == 3)
    split_sliced(module, weights)
    with torch.no_grad():
        after = module(x, index)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
    assert all(isinstance(getattr(module, n), ExpertSlices) for n in weights)
    found, linears = kinds(module, x, index)
    assert "sliced" not in found.values()
    routed = {f"gate_up_proj.{e}" for e in range(3)} | {f"down_proj.{e}" for e in range(3)}
    expected = routed if make is RoutedExperts else {f"{w}.{e}" for w in ("up", "down") for e in range(2)}
    assert linears == expected
    if make is RoutedExperts:  # the identity expert's rows of gate_up_proj: never read, said so
        assert found == {"gate_up_proj.3.weight": "unused"}


def test_each_expert_linear_sees_only_its_tokens():
    torch.manual_seed(0)
    module, x = RoutedExperts(), torch.randn(12, 16)
    index = torch.tensor([0] * 5 + [2] * 7)
    split_sliced(module, ["gate_up_proj", "down_proj"])
    seen = {}

    def count(e):
        def hook(module, args, output):
            seen[e] = seen.get(e, 0) + args[0].shape[0]
        return hook
    for e in range(3):
        module.gate_up_proj[e].register_forward_hook(count(e))
    with torch.no_grad():
        module(x, index)
    assert seen == {0: 5, 2: 7}


def test_a_weight_used_whole_is_not_sliced_and_a_forced_split_is_refused():
    module, x = Mixed(), torch.randn(4, 16)
    found, _ = kinds(module, x, None)
    assert found == {"w": "experts"}
    split_sliced(module, ["w"])
    with pytest.raises(QuantkitError, match="does not split"):
        module(x, None)


def test_load_finds_the_split_weights_by_the_checkpoint_names():
    module = RoutedExperts()
    names = ["gate_up_proj.0.qweight", "gate_up_proj.3.weight", "down_proj.1.scales", "norm.weight"]
    assert sorted(split_in_files(module, names)) == ["down_proj", "gate_up_proj"]
    split_sliced(module, split_in_files(module, names))  # on a skeleton: meta weights, the same names
    assert {n for n, _ in module.named_parameters()} >= {"gate_up_proj.3.weight", "down_proj.2.weight"}

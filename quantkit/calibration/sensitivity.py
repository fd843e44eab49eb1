"""How much each weight's error costs end to end: the diagonal of the Fisher information, for --target-bits.

For a small change δ of the weights, the KL divergence of the model's next-token distribution from the original one is
½ δᵀ F δ per token, F the Fisher information E_{y ~ p}[g gᵀ] of that token (g = ∇ log p(y)). Its diagonal
F_ii = E[g_i²] weighs each weight's squared error; the predicted cost of quantizing a layer is ½ Σ F_ii (w_i − ŵ_i)²,
and the costs of layers add up (the linearity that HIGGS, arXiv 2411.17525, measures end to end). The labels y are
drawn from the model's own distribution (the true Fisher, not the empirical one on the text's tokens). One backward
per calibration window gives every layer's diagonal at once: the gradient of a window's summed log-probabilities has
E[(Σ_t g_t)²] = Σ_t E[g_t²], since tokens' labels are drawn independently, so its square divided by the tokens is the
mean per-token diagonal.

With `hessians`, the same forwards also accumulate each linear's input Hessian Σ x xᵀ (one per distinct input:
q/k/v read one tensor), what GPTQ's error feedback works with (quantkit.algorithms.gptq.feedback_gains).

The pass holds the whole model (a streamed source is loaded whole, then released), the squared gradients (4 bytes
per weight) and with `hessians` the Hessians (4 bytes per input feature squared, per distinct input): its cost is one
forward and one backward per window, which is small next to a GPTQ run's (docs/QUALITY.md, --target-bits).
"""
from functools import partial

import torch

from quantkit.core.errors import QuantkitError
from quantkit.models.arch import is_conv1d
from quantkit.models.head import tied_head


def visit_fisher_diagonals(source, names: list, ids: torch.Tensor, visit, device="cpu", seed: int = 0,
                           hessians: bool = False) -> None:
    """visit(name, module, fisher, hessian) for each linear of `names`, fisher the mean per-token Fisher diagonal of
    its weight ([out, in] float32) over the windows `ids` [n, seqlen], hessian the mean x xᵀ of its inputs ([in, in]
    float32; None without `hessians`, or when no token reached it), while the whole model is loaded (its weights
    real); source: quantkit.models.stream's StreamedModel or InMemoryModel, released afterwards."""
    model = source.model
    tied = tied_head(model)
    source.load_names(source.names)
    if tied is not None:  # loading replaced the embedding's tensor: the head shares it again
        tied[0].weight = tied[1].weight
    unloaded = [n for n, p in model.named_parameters() if p.is_meta]
    if unloaded:  # a forward over a placeholder gives garbage, not an error
        source.release_names(source.names)
        raise QuantkitError(f"--target-bits: the sensitivity pass could not load {unloaded[0]} (a weight the model "
                            "shares in a way quantkit does not know): choose the bits with a recipe instead")
    modules = {n: model.get_submodule(n) for n in names}
    trainable = {id(p): p.requires_grad for p in model.parameters()}
    try:
        model.requires_grad_(False)
        for module in modules.values():
            module.weight.requires_grad_(True)
        inputs = _InputHessians(model, modules) if hessians else None
        try:
            sums, tokens = _squared_gradients(model, modules, ids, device, seed)
        finally:
            if inputs is not None:
                inputs.remove()
        for p in model.parameters():
            p.requires_grad_(trainable.get(id(p), False))
        hessians = inputs.means(names) if inputs is not None else {}
        for name in names:
            fisher = sums.pop(name) / tokens
            visit(name, modules[name], fisher.t() if is_conv1d(modules[name]) else fisher, hessians.get(name))
    finally:
        model.requires_grad_(False)
        source.release_names(source.names)
        if tied is not None:
            tied[0].weight = tied[1].weight


def _squared_gradients(model, modules: dict, ids, device, seed):
    """({name: Σ over windows of the squared gradient of the window's log-probabilities of sampled labels}, tokens)."""
    generator = torch.Generator().manual_seed(seed)
    weights = [m.weight for m in modules.values()]
    sums = {n: torch.zeros(m.weight.shape, dtype=torch.float32, device=m.weight.device) for n, m in modules.items()}
    for window in ids:
        logits = model(window[None].to(device), use_cache=False).logits[0].float()
        log_p = logits.log_softmax(-1)
        labels = _sample(log_p.detach(), generator)
        grads = torch.autograd.grad(log_p.gather(-1, labels).sum(), weights)
        for name, g in zip(sums, grads):
            sums[name] += g.float().square()
    return sums, ids.numel()


def _sample(log_p: torch.Tensor, generator) -> torch.Tensor:
    """[tokens, 1]: one label per token drawn from exp(log_p) [tokens, vocab], by inverse CDF (torch.multinomial
    costs 8x more on a CPU at a vocabulary of 49k)."""
    u = torch.rand(log_p.shape[0], 1, generator=generator).to(log_p.device)
    cdf = log_p.exp().cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=log_p.shape[1] - 1)


class _InputHessians:
    """Forward pre-hooks summing x xᵀ over each linear's input tokens; a linear fed the very tensor an earlier one of
    the same forward was (k and v after q) reads that one's sum instead of keeping its own."""

    def __init__(self, model, modules: dict):
        self.sums, self.tokens, self.same_as = {}, {}, {}
        self.seen = []  # (input tensor, the first linear fed it) of the current forward
        self.handles = [m.register_forward_pre_hook(partial(self._observe, name)) for name, m in modules.items()]
        self.handles.append(model.register_forward_pre_hook(lambda *_: self.seen.clear()))

    def _observe(self, name, module, args):
        if not args:
            return
        x = args[0]
        first = next((n for t, n in self.seen if t is x), None)
        if first is not None and first != name:
            self.same_as[name] = first
            return
        if first is None:
            self.seen.append((x, name))
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if name not in self.sums:
            self.sums[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            self.tokens[name] = 0
        self.sums[name].addmm_(x.t(), x)
        self.tokens[name] += x.shape[0]

    def means(self, names) -> dict:
        """{name: the mean x xᵀ of its inputs (the very tensor of the linear whose input it shares), None when it saw
        none}."""
        for name, tokens in self.tokens.items():
            self.sums[name] /= tokens
        return {n: self.sums.get(self.same_as.get(n, n)) for n in names}

    def remove(self):
        for h in self.handles:
            h.remove()
        self.seen.clear()

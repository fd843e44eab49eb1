"""Mixture-of-experts layers as plain linears: transformers 5's fused expert tensors split into one module per expert.

transformers 5 holds a MoE layer's experts as 3-D parameters (`experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I], transposed in some families, with biases in others) and runs them with its own
forward (transformers.integrations.moe.use_experts_implementation). quantkit quantizes linears, so before any
work a model's fused experts are replaced by ExpertLinears: a ModuleList of E experts, each a gate_proj, up_proj
and down_proj nn.Linear holding that expert's slices, and a forward that computes exactly the eager forward of
the fused module (the same tokens to the same experts, the same gate, the same routing weights). Each expert's
linears then see only the tokens routed to it (its own Hessian), are written per expert
(`mlp.experts.3.gate_proj.qweight`: the names the original Qwen-MoE checkpoints use) and load back the same way.

Layouts the eager forward describes are split: concatenated [gate; up] or interleaved [g0, u0, g1, u1, ...]
rows, transposed or not, with or without biases, any gate function (the module's own `_apply_gate`: gpt-oss clamps
its SwiGLU), or ungated (Nemotron-H: up_proj, the activation, down_proj). Llama 4's experts are the other kind
(INPUT_SCALED): its MoE layer multiplies each token by the router's sigmoid score *before* the experts and hands them
every token, [experts x tokens, hidden], unrouted ones as zero rows; InputScaledExperts computes each expert on its
nonzero rows only. Others (a post-expert norm) stay fused and run their eager forward, which
quantkit.models.sliced splits when it takes one expert at a time; what it cannot split, quantize refuses by name.
"""
import torch
from torch import nn

from quantkit.models.sliced import ExpertSlices

# what transformers.integrations.moe.use_experts_implementation sets on a fused experts module
LAYOUT_FLAGS = ("is_concatenated", "is_transposed", "has_bias", "has_gate", "has_post_expert_norm")


class Expert(nn.Module):
    """One expert of a split MoE layer: gate_proj (gated experts only), up_proj [I, H] and down_proj [H, I]."""

    def __init__(self, hidden: int, inter: int, bias: bool, device=None, dtype=None, gated=True):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        if gated:
            self.gate_proj = nn.Linear(hidden, inter, **kw)
        self.up_proj = nn.Linear(hidden, inter, **kw)
        self.down_proj = nn.Linear(inter, hidden, **kw)


class ExpertLinears(nn.ModuleList):
    """A fused experts module split into one Expert per expert; forward(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) as the fused module's eager forward.

    Two switches for calibration (quantkit.calibration.sequential): all_tokens, every expert also computes every
    token (--moe-calibration all: each expert's statistics cover all of them) while the output still sums the
    routed experts' results only; routed_counts, when a tensor [E], counts the tokens routed to each expert."""

    def __init__(self, experts: list, is_concatenated: bool, apply_gate):
        super().__init__(experts)
        self.is_concatenated = is_concatenated
        # the fused module's gate function (gpt-oss's clamps), or an ungated one's activation: not a submodule of the
        # list (an activation module would count as one more expert)
        object.__setattr__(self, "apply_gate", apply_gate)
        self.all_tokens = False
        self.routed_counts = None

    def expert_output(self, e: int, x):
        """Expert e's output for tokens x [t, H] (before the routing weight). An ungated expert (Nemotron-H's):
        down(act(up(x))), apply_gate being the activation."""
        expert = self[e]
        if not hasattr(expert, "gate_proj"):
            return expert.down_proj(self.apply_gate(expert.up_proj(x)))
        g, u = expert.gate_proj(x), expert.up_proj(x)
        gate_up = torch.cat([g, u], dim=-1) if self.is_concatenated else torch.stack([g, u], dim=-1).flatten(-2)
        return expert.down_proj(self.apply_gate(gate_up))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.routed_counts is not None:
            self.routed_counts += torch.bincount(top_k_index.flatten().cpu(), minlength=len(self) + 1)[:len(self)]
        if self.all_tokens:
            return self._forward_all_tokens(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == len(self):  # the masked index some routers use for dropped slots
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            y = self.expert_output(e, hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def _forward_all_tokens(self, hidden_states, top_k_index, top_k_weights):
        """Every expert on every token; the routed tokens' results summed as the routed forward sums them."""
        out = torch.zeros_like(hidden_states)
        for e in range(len(self)):
            y = self.expert_output(e, hidden_states)
            token_idx, top_k_pos = torch.where(top_k_index == e)
            if token_idx.numel():
                out.index_add_(0, token_idx, (y[token_idx] * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out


class InputScaledExperts(ExpertLinears):
    """Llama 4's experts split: forward(routed_in [E x T, H]) -> [E x T, H], where routed_in holds every token
    once per expert, multiplied by that expert's router score (0 when not routed to it). Each expert computes its
    nonzero rows only (a zero row's output is zero: the experts have no bias), so its linears see its routed tokens.
    With all_tokens, each expert computes every token scaled by the sigmoid of its own router logit (the score it
    would have had), read from the router by a forward hook; the output keeps the routed rows only."""

    router_view = None  # (hidden [T, H], router logits [T, E]) of the last router call, while all_tokens is on

    def forward(self, routed_in):
        x = routed_in.view(len(self), -1, routed_in.shape[-1])
        out = torch.zeros_like(x)
        for e in range(len(self)):
            rows = x[e].abs().amax(dim=-1).nonzero()[:, 0]
            if self.routed_counts is not None:
                self.routed_counts[e] += rows.numel()
            if self.all_tokens and self.router_view is not None:
                hidden, logits = self.router_view
                y = self.expert_output(e, hidden * torch.sigmoid(logits[:, e:e + 1].float()).to(hidden.dtype))[rows]
            elif rows.numel():
                y = self.expert_output(e, x[e, rows])
            else:
                continue
            out[e, rows] = y.to(out.dtype)
        return out.view_as(routed_in)

    def see_router(self, module, args, output) -> None:
        self.router_view = (args[0], output[1]) if self.all_tokens else None


class FlatExperts(ExpertLinears):
    """DBRX's experts split: hidden states [batch, tokens, H] in and out, routed as [batch x tokens] rows."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        return super().forward(flat, top_k_index, top_k_weights).view(hidden_states.shape)


# experts modules, by class, that take router-scaled inputs of every token (their MoE layer's router module name)
INPUT_SCALED = {"Llama4TextExperts": "router"}
# experts modules, by class, whose GLU weights are 2-D, every expert's rows stacked: [experts x I, H] gate (w1), up
# (v1) and down (w2, transposed), in the submodule named here, which computes act(x w1^T) * (x v1^T) w2 per expert
STACKED_GLU = {"DbrxExperts": "mlp"}


def _input_scaled(module: nn.Module) -> bool:
    return type(module).__name__ in INPUT_SCALED


def _swiglu_chunks(act_fn):
    """Llama 4's gate: the first half of gate_up is the gate, the second the up projection."""
    def apply(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return up * act_fn(gate)
    return apply


def splittable(module: nn.Module) -> bool:
    """A fused experts module whose eager forward ExpertLinears (or InputScaledExperts) reproduces."""
    if _input_scaled(module) or type(module).__name__ in STACKED_GLU:
        return True
    flags = [getattr(module, f, None) for f in LAYOUT_FLAGS]
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None) if None not in flags else None
    return (None not in flags and not module.has_post_expert_norm
            and isinstance(first, nn.Parameter) and first.dim() == 3
            and isinstance(getattr(module, "down_proj", None), nn.Parameter) and module.down_proj.dim() == 3)


def _experts(gate_up, down, bias, concatenated, gated=True) -> list:
    """One Expert per slice of gate_up [E, 2I, H] (ungated: up [E, I, H]) and down [E, H, I] (bias: (gate_up_bias,
    down_bias) or None)."""
    n, rows_in, hidden = gate_up.shape
    inter = rows_in // 2 if gated else rows_in
    rows = (slice(0, inter), slice(inter, rows_in)) if concatenated else (slice(0, None, 2), slice(1, None, 2))
    if not gated:
        rows = (None, slice(0, rows_in))
    experts = []
    for e in range(n):
        expert = Expert(hidden, inter, bias is not None, device=gate_up.device, dtype=gate_up.dtype, gated=gated)
        values = {"up_proj.weight": gate_up[e, rows[1]], "down_proj.weight": down[e]}
        if gated:
            values["gate_proj.weight"] = gate_up[e, rows[0]]
        if bias is not None:
            values.update({"up_proj.bias": bias[0][e, rows[1]], "down_proj.bias": bias[1][e]})
            if gated:
                values["gate_proj.bias"] = bias[0][e, rows[0]]
        if gate_up.device.type != "meta":
            expert.load_state_dict({k: v.contiguous() for k, v in values.items()})
        experts.append(expert)
    return experts


def _split_stacked(fused: nn.Module) -> FlatExperts:
    """DBRX's experts: w1, v1 and w2 [E x I, H] of its GLU submodule as E gate, up and down linears."""
    glu = fused.get_submodule(STACKED_GLU[type(fused).__name__])
    n = fused.num_experts
    w1, v1, w2 = (getattr(glu, w).detach().view(n, -1, glu.w1.shape[-1]) for w in ("w1", "v1", "w2"))
    inter = w1.shape[1]

    def apply_gate(gate_up):
        return glu.activation_fn(gate_up[..., :inter]) * gate_up[..., inter:]
    return FlatExperts(_experts(torch.cat([w1, v1], dim=1), w2.transpose(1, 2), None, True), True, apply_gate)


def split(fused: nn.Module) -> ExpertLinears:
    """ExpertLinears holding `fused`'s weights (on the meta device too, for a skeleton)."""
    if type(fused).__name__ in STACKED_GLU:
        return _split_stacked(fused)
    gate_up = (fused.gate_up_proj if _input_scaled(fused) or fused.has_gate else fused.up_proj).detach()
    down = fused.down_proj.detach()
    if _input_scaled(fused):  # [E, H, 2I] and [E, I, H], [gate; up] concatenated
        experts = _experts(gate_up.transpose(1, 2), down.transpose(1, 2), None, True)
        return InputScaledExperts(experts, True, _swiglu_chunks(fused.act_fn))
    if fused.is_transposed:  # [E, in, out] -> nn.Linear's [E, out, in]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    first = "gate_up_proj" if fused.has_gate else "up_proj"
    bias = (getattr(fused, f"{first}_bias"), fused.down_proj_bias) if fused.has_bias else None
    return ExpertLinears(_experts(gate_up, down, bias, fused.is_concatenated, fused.has_gate), fused.is_concatenated,
                         fused._apply_gate if fused.has_gate else fused.act_fn)


def split_experts(model: nn.Module) -> nn.Module:
    """Replace every splittable fused experts module of `model` by its ExpertLinears, in place; returns model."""
    targets = [(name, m) for name, m in model.named_modules() if splittable(m)]
    for name, fused in targets:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, split(fused))
        if _input_scaled(fused):  # the router's input and logits, for --moe-calibration all
            router = owner.get_submodule(INPUT_SCALED[type(fused).__name__])
            router.register_forward_hook(getattr(owner, leaf).see_router)
        for p in ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias",
                  "down_proj_bias"):  # the copies hold them now
            if hasattr(fused, p):
                setattr(fused, p, None)
    _eager_experts(model)
    return model


def _eager_experts(model: nn.Module) -> None:
    """Fused experts left whole (no layout above fits them: Muse Spark's norm after each expert) run their eager
    forward, one F.linear(x, W[e]) per expert, the forward the use trace reads and quantkit.models.sliced splits;
    transformers' default grouped_mm would hide the experts in one product."""
    left = any(all(hasattr(m, f) for f in LAYOUT_FLAGS) for m in model.modules())
    if left and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")


def expert_of(block: nn.Module, linear: str):
    """(ExpertLinears, expert index) of a routed expert's linear (a name inside `block`), else None."""
    parts = linear.split(".")
    for i in range(1, len(parts) - 1):
        module = block.get_submodule(".".join(parts[:i]))
        if isinstance(module, ExpertLinears):
            return module, int(parts[i])
    return None


def is_routed(block: nn.Module, linear: str) -> bool:
    """Whether `linear` belongs to a routed expert (also one of quantkit.models.sliced): it may see no calibration
    token."""
    owner = linear.rpartition(".")[0]
    return expert_of(block, linear) is not None or isinstance(block.get_submodule(owner), ExpertSlices)


def set_all_tokens(block: nn.Module, on: bool) -> None:
    """--moe-calibration all (on) or routed: whether the block's experts compute every token while calibrated."""
    for module in block.modules():
        if isinstance(module, ExpertLinears):
            module.all_tokens = on
        if isinstance(module, InputScaledExperts):
            module.router_view = None

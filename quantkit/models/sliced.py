"""Fused experts no layout describes, split by what their own forward does with them.

Some families hold experts as 3-D parameters [E, out, in] and multiply them in a forward of their own that
quantkit.models.moe's layouts do not describe: JetMoE's ParallelExperts (F.linear(x, W[e]) per expert), LongCat-Flash's
experts beside its identity ("zero") experts, Muse Spark's experts with a norm after each, Inkling's shared experts
(one batched product, bmm(x, W.transpose(1, 2)), every expert on every token). When the use trace
(quantkit.models.uses) sees a parameter used only in those two ways (kind "sliced"), split_sliced turns it into
ExpertSlices, a ModuleList of E nn.Linear named `<parameter>.<e>` (`mlp.experts.gate_up_proj.3`), and the module
keeps its own forward: around it, SliceMode hands out a stand-in for W[e] and answers F.linear(x, stand-in) with
linear e of x (the batched product: each expert's linear of its own rows). The module computes what it did before,
whatever else it does (routing, zero experts, norms) untouched, and each expert's linear sees only its own tokens,
as a split expert of moe.py does. load_quantized splits the same parameters again, found by the checkpoint's names.
"""
import weakref

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from quantkit.core.errors import QuantkitError

TAKE = torch.Tensor.__getitem__
TRANSPOSE = {torch.Tensor.transpose, torch.transpose}
BATCHED = {torch.bmm, torch.Tensor.bmm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def expert_index(index):
    """The expert an index into a 3-D weight picks (W[3], W[torch.tensor(3)]), else None (a range, a mask)."""
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    if isinstance(index, torch.Tensor) and index.numel() == 1 and not index.is_floating_point() \
            and index.dtype != torch.bool:
        return int(index)
    return None


def swaps_last_two(args, kwargs) -> bool:
    """Whether transpose(*args) swaps a 3-D tensor's last two dimensions (W.transpose(1, 2))."""
    dims = [*args[1:3], *(kwargs.get(k) for k in ("dim0", "dim1") if k in kwargs)]
    return sorted(d % 3 for d in dims) == [1, 2]


class ExpertSlices(nn.ModuleList):
    """A 3-D parameter [E, out, in] as E nn.Linear(in, out): expert e's linear holds W[e]."""


def _expert_linears(weight: torch.Tensor) -> ExpertSlices:
    n, out_features, in_features = weight.shape
    linears = ExpertSlices()
    for e in range(n):
        linear = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=weight.dtype)
        if weight.device.type != "meta":  # a copy: a view would keep the whole 3-D tensor alive and shared
            linear.weight = nn.Parameter(weight[e].clone(), requires_grad=False)
        linears.append(linear)
    return linears


class SlicedForward:
    """Mixed into the class of a module whose 3-D parameters were split (its `sliced`: {name: (shape, dtype)}):
    its own forward, run with a stand-in for each split parameter, under SliceMode."""

    def forward(self, *args, **kwargs):
        stand_ins = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype)
                     in self.sliced.items()}
        self.__dict__.update(stand_ins)  # found before the ModuleList of the same name (nn.Module's __getattr__)
        try:
            with SliceMode({id(t): self._modules[name] for name, t in stand_ins.items()}):
                return super().forward(*args, **kwargs)
        finally:
            for name in stand_ins:
                del self.__dict__[name]


_CLASSES = {}


def _sliced_class(cls):
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Sliced{cls.__name__}", (SlicedForward, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


class SliceMode(TorchFunctionMode):
    """The calls of one forward of a split module: W[e] of a stand-in W gives a stand-in of expert e, F.linear of it
    runs expert e's linear, W.transpose(1, 2) and a batched product with it run every expert on its own rows.
    A stand-in's shape and dtype can be read; any other use of it is refused (it holds no values)."""

    def __init__(self, linears_of: dict):
        super().__init__()
        self.linears_of = linears_of  # id(stand-in of a 3-D weight) -> its ExpertSlices
        self.made = {}  # id(derived stand-in) -> (weakref, ("expert", linear) or ("all", ExpertSlices))

    def _derived(self, t):
        entry = self.made.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        linears = self.linears_of.get(id(first)) if isinstance(first, torch.Tensor) else None
        expert = expert_index(args[1]) if linears is not None and func is TAKE else None
        if expert is not None:
            return self._made(func(*args), ("expert", linears[expert]))
        if linears is not None and func in TRANSPOSE and swaps_last_two(args, kwargs):
            return self._made(func(*args, **kwargs), ("all", linears))
        weight = args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("other"))
        use = self._derived(weight)
        if use is not None and use[0] == "expert" and func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = use[1](args[0])
            return y if bias is None else y + bias
        if use is not None and use[0] == "all" and func in BATCHED and args[0].dim() == 3:
            return torch.stack([linear(args[0][e]) for e, linear in enumerate(use[1])])
        out = func(*args, **kwargs)
        touched = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                   and (id(t) in self.linears_of or self._derived(t) is not None)]
        if touched and any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            raise QuantkitError(f"a split expert weight is used by {getattr(func, '__name__', func)} in a way quantkit "
                                "does not split (only W[e] as F.linear's weight, or a batched product with "
                                "W.transpose(1, 2)): this checkpoint's experts cannot run in this version")
        return out

    def _made(self, t, use):
        self.made[id(t)] = (weakref.ref(t), use)
        return t


def split_sliced(model: nn.Module, params) -> dict:
    """Split each 3-D parameter named in `params` (full names in `model`) into ExpertSlices, in place (meta
    parameters too, for a skeleton); returns {parameter: its experts' weight names}."""
    new = {}
    for full in params:
        owner_name, _, leaf = full.rpartition(".")
        owner = model.get_submodule(owner_name)
        weight = owner._parameters.pop(leaf)
        owner.add_module(leaf, _expert_linears(weight.detach()))
        sliced = dict(getattr(owner, "sliced", {}))
        sliced[leaf] = (tuple(weight.shape), weight.dtype)
        owner.sliced = sliced
        if not isinstance(owner, SlicedForward):
            owner.__class__ = _sliced_class(type(owner))
        new[full] = [f"{full}.{e}.weight" for e in range(weight.shape[0])]
    return new


def split_in_files(model: nn.Module, names) -> list[str]:
    """The 3-D parameters of `model` that a checkpoint's tensor `names` hold split (`<parameter>.<e>.…`)."""
    prefixes = {n.rsplit(".", 2)[0] for n in names if n.count(".") >= 2 and n.rsplit(".", 2)[1].isdigit()}
    return [n for n, p in model.named_parameters() if p.dim() == 3 and n in prefixes]

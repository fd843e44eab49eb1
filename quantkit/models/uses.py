"""What each weight of a decoder block is, decided by how one forward of the block uses it, not by its name or shape.

UseTrace watches one forward of a block (a torch function mode: every torch call the block's code makes passes
through it) and records, for every parameter of the block, the calls that read it and whether the module owning it
was running at the time; for every tensor the forward makes, which linears it depends on. From that:

  linear     the weight of a linear layer (nn.Linear, GPT-2's Conv1D) that only its own forward multiplies
             (F.linear): quantizable, its stage given by the linears its input depends on
  router     a linear whose output, a few operations on, selects (top-k, argmax, sort) or gates through a sigmoid
             with one output: a mixture-of-experts router (or the expert gate of Qwen2-MoE), in float whatever it is
             called, because rounding it moves routing decisions
  conv       a convolution kernel (the depthwise conv1d of Mamba and linear-attention layers)
  read       a linear's weight read by code outside its own forward (DeepSeek-V3.2's indexer reads
             weights_proj.weight.dtype, HunYuan's router wg.weight.dtype): a packed layer has no such tensor, so the
             layer stays in float
  unused     never read by the forward (Gemma's KV-shared layers keep k/v projections they do not call)
  shared     a linear of a module several blocks hold, one object (Zamba's shared attention block): quantkit
             calibrates and writes a block's linears from that block alone, so it stays in float (set by
             quantkit.calibration.capture, which sees every block)
  sliced     a 3-D parameter used only one expert at a time, as F.linear(x, W[e]), or in a batched product with
             W.transpose(1, 2): fused experts quantkit.models.sliced splits into linears (then traced again)
  experts    a 3-D parameter multiplied as weights otherwise (fused experts no part of quantkit can split)
  other      anything else not multiplied as a linear layer: SSM parameters (A_log, D), per-layer scalars, statics
The trace needs one forward of the block with the arguments the model gives it (quantkit.calibration.capture).
"""
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from quantkit.models.arch import is_conv1d, is_linear
from quantkit.models.sliced import BATCHED, TAKE, TRANSPOSE, expert_index, swaps_last_two

CONV_OPS = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d}
PRODUCT_OPS = {torch.matmul, torch.mm, torch.bmm, torch.baddbmm, torch.addmm, torch.einsum, torch.Tensor.matmul,
               torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm}
for _grouped in ("_grouped_mm", "grouped_mm"):
    if hasattr(torch, _grouped):
        PRODUCT_OPS.add(getattr(torch, _grouped))
SELECT_OPS = {torch.topk, torch.Tensor.topk, torch.argmax, torch.Tensor.argmax, torch.sort, torch.Tensor.sort,
              torch.argsort, torch.Tensor.argsort}
SIGMOID_OPS = {torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid}
# calls that give a parameter back in another dtype or layout: the result still is that parameter (DeepSeek's router
# multiplies gate.weight.float(), the reference causal conv1d convolves with conv1d.weight.squeeze(1))
CAST_OPS = {getattr(torch.Tensor, name) for name in (
    "float", "to", "type", "half", "bfloat16", "contiguous", "view", "reshape", "squeeze", "unsqueeze", "t",
    "transpose", "permute", "flatten", "__getitem__")} | {torch._C.TensorBase.T.__get__, torch._C.TensorBase.mT.__get__}
# calls that read what a tensor is, not what it holds: no use of a weight (Inkling's experts read W.shape)
META_OPS = {getattr(torch._C.TensorBase, name).__get__ for name in ("shape", "dtype", "device", "ndim", "is_meta",
                                                                     "is_cuda", "layout")} | {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point, torch.Tensor.element_size}
# a router's logits reach the top-k within a few operations (softmax, a bias, a view, a group top-k); a hidden state
# that passed through several more (a norm, a residual) selects nothing by itself
ROUTE_HOPS = 6

FLOAT_KINDS = ("router", "conv", "read", "unused", "shared", "other")
KIND_WORDS = {"router": ("router", "routers"), "conv": ("conv kernel", "conv kernels"),
              "read": ("weight the model's code reads", "weights the model's code reads"),
              "unused": ("weight the forward never reads", "weights the forward never reads"),
              "shared": ("weight several blocks share", "weights several blocks share"),
              "other": ("other parameter", "other parameters")}


@dataclass
class BlockUses:
    """One block's weights by use. stages: its quantizable linears (names in the block) in dependency order, each
    stage's linears independent of one another; kinds: {weight name in the block: kind} of every other floating
    weight of two or more dims (FLOAT_KINDS, or "experts"); output: the structure of what the block returns (a tensor,
    or a tuple whose further elements the decoder hands to the next block: GLM-5's top-k indices)."""
    stages: tuple[tuple[str, ...], ...] = ()
    kinds: dict = field(default_factory=dict)
    output: object = None  # the pytree structure of what the block returns (its hidden states first)

    @property
    def linears(self) -> set[str]:
        return {n for stage in self.stages for n in stage}


class UseTrace(TorchFunctionMode):
    """Enter around one forward of `block`; read `result()` after. materialize(name in the block) -> tensor, if
    given, reads a parameter still on the meta device for the one call that uses it: a streamed block is traced
    holding one weight at a time."""

    def __init__(self, block: nn.Module, materialize=None):
        super().__init__()
        self.block, self.materialize = block, materialize
        self.owner = {}  # id(parameter) -> (its name in the block, its module's name)
        for mod_name, module in block.named_modules():
            for leaf, p in module.named_parameters(recurse=False):
                self.owner.setdefault(id(p), (f"{mod_name}.{leaf}" if mod_name else leaf, mod_name))
        self.casts = {}  # id(a parameter cast to another dtype) -> (weakref, the parameter's owner entry)
        self.slices = {}  # id(W[e] or W.transpose(1, 2) of a 3-D parameter W) -> (weakref, the product it fits)
        self.running = []  # names of the block's modules whose forward is running, innermost last
        self.uses = {}  # parameter name -> {"linear", "sliced", "conv", "product", "read", "other"}
        self.linear_order, self.linear_deps = [], {}  # linears in call order; the linears their inputs depend on
        self.routers = set()
        self.by_product, self.not_linear = set(), set()  # linears multiplied by a product in this call; not x W^T
        self._checking = False
        self.tensors = {}  # id(tensor) -> (weakref, the linears it depends on, {linear: operations since})
        self._handles = []

    def __enter__(self):
        self.running = [""]  # the block's own forward, around which the trace is entered
        for name, module in self.block.named_modules(remove_duplicate=False):
            if not name:
                continue
            self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._enter_module(n)))
            self._handles.append(module.register_forward_hook(
                lambda m, a, o, n=name: self._leave_module(n, m, a, o)))
        return super().__enter__()

    def _enter_module(self, name: str) -> None:  # a hook's result would replace the module's input or output
        self.running.append(name)

    def _leave_module(self, name: str, module: nn.Module, args, output) -> None:
        self.running.pop()
        if name in self.by_product:  # a linear subclass's own product: is it x W^T + b?
            self.by_product.discard(name)
            self._checking = True  # the check's own calls are not the block's
            try:
                if not self._computes_linear(module, args, output):
                    self.not_linear.add(name)  # DeepSeek-V4's grouped (block-diagonal) o_a_proj
            finally:
                self._checking = False

    def _computes_linear(self, module, args, output) -> bool:
        weight, bias = (self.materialize(self.owner[id(t)][0]) if t is not None and t.is_meta else t
                        for t in (module.weight, module.bias))
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
            return False
        w = weight.t() if is_conv1d(module) else weight
        if x.shape[-1] != w.shape[1] or output.shape != (*x.shape[:-1], w.shape[0]):
            return False
        expected = F.linear(x.to(w.dtype), w, bias).float()
        return torch.allclose(expected, output.float(), rtol=1e-2, atol=1e-3 * float(expected.abs().max()) + 1e-6)

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._checking:
            return func(*args, **kwargs)
        leaves = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        params = [(x, owner) for x in leaves if (owner := self._owner(x)) is not None]
        deps, near = self._ancestry(leaves)
        if func in SELECT_OPS:
            self.routers.update(near)
        elif func in SIGMOID_OPS:
            self.routers.update(n for n in near if self._one_output(n))
        if self.materialize is not None and any(p.is_meta for p, _ in params):
            real = {id(p): self.materialize(name) for p, (name, _) in params if p.is_meta}
            args, kwargs = tree_map(lambda x: real.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        out = func(*args, **kwargs)
        if func in CAST_OPS and params and leaves[0] is params[0][0] and isinstance(out, torch.Tensor):
            self.casts[id(out)] = (weakref.ref(out), params[0][1])
            self._note_slice(func, leaves[0], args, kwargs, out)
        linear = self._record(func, params, leaves)
        if linear is not None:
            deps, near = deps | {linear}, {linear: 0}
        else:
            near = {n: h + 1 for n, h in near.items() if h + 1 < ROUTE_HOPS}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in self.owner:
                self.tensors[id(t)] = (weakref.ref(t), deps, near)
        return out

    def _note_slice(self, func, w, args, kwargs, out) -> None:
        """W[e] or W.transpose(1, 2) taken of a 3-D parameter W itself: what quantkit.models.sliced can split."""
        if id(w) not in self.owner or w.dim() != 3:
            return
        if func is TAKE and expert_index(args[1]) is not None:
            self.slices[id(out)] = (weakref.ref(out), F.linear)
        elif func in TRANSPOSE and swaps_last_two(args, kwargs):
            self.slices[id(out)] = (weakref.ref(out), "batched")

    def _sliced_use(self, func, p, leaves) -> bool:
        entry = self.slices.get(id(p))
        if entry is None or entry[0]() is not p or len(leaves) < 2 or leaves[1] is not p:
            return False
        return func is entry[1] or (entry[1] == "batched" and func in BATCHED and leaves[0].dim() == 3)

    def _owner(self, x):
        """(name, module name) of the block's parameter `x` is, or is a cast of; None for any other tensor."""
        if id(x) in self.owner:
            return self.owner[id(x)]
        cast = self.casts.get(id(x))
        return cast[1] if cast is not None and cast[0]() is x else None

    def _ancestry(self, leaves):
        """(the linears the tensors depend on, {linear: fewest operations since its output}) over `leaves`."""
        deps, near = frozenset(), {}
        for x in leaves:
            info = self.tensors.get(id(x))
            if info is None or info[0]() is not x:  # an id reused by a new tensor
                continue
            deps = deps | info[1]
            for n, h in info[2].items():
                near[n] = min(h, near.get(n, h))
        return deps, near

    def _record(self, func, params, leaves):
        """Note each parameter's use; the name of the linear module whose own forward this call is, else None."""
        linear = None
        for p, (name, module) in params:
            uses = self.uses.setdefault(name, set())
            if module not in self.running:  # read by another module's code
                uses.add("read")
            if func in CAST_OPS or func in META_OPS:
                continue  # the parameter in another dtype or layout: its use is what the cast is used for
            if self._sliced_use(func, p, leaves):
                uses.add("sliced")
            elif self._multiplies(func, p, leaves, module):
                uses.add("linear")
                linear = module
            else:
                uses.add("conv" if func in CONV_OPS else "product" if func in PRODUCT_OPS else "other")
        if linear is not None and linear not in self.linear_deps:
            self.linear_order.append(linear)
            inputs = [x for x in leaves if self._owner(x) is None]  # addmm's bias comes before its input
            self.linear_deps[linear] = self._ancestry(inputs[:1])[0]
        return linear

    def _multiplies(self, func, p, leaves, module: str) -> bool:
        """Whether this call multiplies the inputs by `p` as a linear layer does, in the linear's own forward:
        F.linear's weight, or a product with it (GPT-2's Conv1D addmm, Falcon's x @ weight.T)."""
        if self.running[-1] != module:
            return False
        if func is F.linear:
            return len(leaves) > 1 and leaves[1] is p
        if func in PRODUCT_OPS and is_linear(self.block.get_submodule(module)) and any(x is p for x in leaves[1:]):
            self.by_product.add(module)  # checked against F.linear when the module returns
            return True
        return False

    def _one_output(self, module_name: str) -> bool:
        module = self.block.get_submodule(module_name)
        return is_linear(module) and _rows(module) == 1

    def result(self) -> BlockUses:
        kinds, linears = {}, []
        for name, p in self.block.named_parameters():
            if p.dim() < 2 or not p.is_floating_point():
                continue  # norms, biases, integer buffers: not weights
            module_name, _, leaf = name.rpartition(".")
            kind = self._kind(name, p, module_name, leaf)
            if kind == "linear":
                linears.append(module_name)
            else:
                kinds[name] = kind
        return BlockUses(self._stages(linears), kinds)

    def _kind(self, name, p, module_name, leaf) -> str:
        uses = self.uses.get(name, set())
        module = self.block.get_submodule(module_name) if module_name else self.block
        if not uses:  # fused 3-D experts this forward sent no token to are still experts, and refused as such
            return "experts" if p.dim() == 3 else "unused"
        if p.dim() == 3 and uses == {"sliced"}:
            return "sliced"
        if module_name in self.routers:
            return "router"
        if "read" in uses and is_linear(module):
            return "read"
        if is_linear(module) and leaf == "weight" and uses == {"linear"} and module_name not in self.not_linear:
            return "linear"
        if "conv" in uses:
            return "conv"
        if p.dim() == 3 and uses & {"product", "linear", "sliced"}:
            return "experts"
        return "other"

    def _stages(self, linears) -> tuple[tuple[str, ...], ...]:
        """The linears in call order, each in the stage after the latest of those its input depends on."""
        stage_of = {}
        for n in (n for n in self.linear_order if n in set(linears)):
            stage_of[n] = 1 + max((stage_of[d] for d in self.linear_deps[n] if d in stage_of), default=-1)
        stages = [[] for _ in range(max(stage_of.values(), default=-1) + 1)]
        for n, s in stage_of.items():
            stages[s].append(n)
        return tuple(tuple(s) for s in stages if s)


def _rows(module: nn.Module) -> int:
    return module.weight.shape[1 if is_conv1d(module) else 0]


def kind_words(kind: str, count: int) -> str:
    """'3 conv kernels', '1 router': a float kind as the summary says it."""
    one, many = KIND_WORDS.get(kind, (kind, kind))
    return f"{count} {one if count == 1 else many}"

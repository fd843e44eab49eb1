"""What each decoder block receives in the model's own forward, and how each block uses its weights.

capture_block_calls: every block's arguments for every calibration sample, as the decoder's own loop passes them:
the hidden states of block 0, and for each block the rest (Gemma 4's per-layer input, the position embeddings and
mask of the block's attention type, a hybrid stack's linear-attention mask, the KV-sharing store its later layers
read). The decoder runs once per sample with every block replaced by a stand-in that records its call and hands its
hidden states on unchanged: no block computes, so it costs the embeddings and the masks.

trace_blocks: one real forward of a few tokens through the whole model, each block's calls watched by
quantkit.models.uses.UseTrace: what each of its weights is, decided by use, before any work. A streamed source's
block holds its small tensors for the forward and reads each weight for the one call that uses it: one weight is
held at a time, as in a data-free run.
"""
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from quantkit.calibration.runner import Carried, StopForward, check_activations
from quantkit.core.errors import QuantkitError
from quantkit.models.arch import get_submodule, vocabulary
from quantkit.models.moe import set_all_tokens
from quantkit.models.placement import move_loaded
from quantkit.models.uses import META_OPS, BlockUses, UseTrace

# keyword arguments of a block that hold a generation cache: calibration samples are independent forwards
CACHE_ARGS = ("past_key_values", "past_key_value", "cache", "cache_params")
TRACE_TOKENS = 16


@contextmanager
def moved_outside(model: nn.Module, blocks_path: str, device):
    """Every parameter and buffer outside the decoder blocks (embeddings, rotary, final norm) on `device` for the
    duration, on the CPU after; tensors still on the meta device (a streamed model's, loaded on first use) stay."""
    outside = [m for name, m in model.named_modules()
               if not (name == blocks_path or name.startswith(blocks_path + "."))]
    for module in outside:
        move_loaded(module, device, recurse=False)
    try:
        yield
    finally:
        for module in outside:
            move_loaded(module, "cpu", recurse=False)


@dataclass
class BlockCalls:
    """inputs: the first block's hidden states, one [1, L, H] per sample; calls[sample][block]: (the block's
    positional arguments after the hidden states, its keyword arguments), for each block the model's forward called
    (a text forward skips Mllama's cross-attention layers). Tensors equal in every sample are held once."""
    inputs: list
    calls: list

    def of_block(self, i: int) -> list | None:
        """[(args, kwargs)] of block i, one per sample; None when the model's forward never called it."""
        ran = sum(i in sample for sample in self.calls)
        if ran == 0:
            return None
        if ran < len(self.calls):
            raise QuantkitError(f"the model's forward ran its block {i} on {ran} of the {len(self.calls)} calibration "
                                "samples only: quantkit calibrates a block on every sample or none; this family "
                                "needs a table entry (quantkit/models/families.py)")
        return [sample[i] for sample in self.calls]


def capture_block_calls(model, arch, input_ids: torch.Tensor, device, store_device="cpu", traced=None) -> BlockCalls:
    """BlockCalls of `model` (its blocks' weights may be on the meta device: none is read) for each row of
    input_ids. traced: the blocks' BlockUses, whose output structure each stand-in returns (Carried in place of the
    further elements); without it a stand-in returns the hidden states alone."""
    blocks = get_submodule(model, arch.blocks)
    inputs, calls = [], []

    def stand_in(i):
        def forward(*args, **kwargs):
            hidden, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
            if not calls[-1]:
                inputs.append(check_activations(hidden.detach(), f"the inputs of block {i}").to(store_device))
            kwargs = {k: (None if k in CACHE_ARGS else v) for k, v in kwargs.items()}
            previous = calls[-2].get(i) if len(calls) > 1 else None
            calls[-1][i] = _shared_with(previous, _to(tuple(rest), kwargs, store_device))
            if i == len(blocks) - 1:
                raise StopForward  # the rest of the model is not needed
            return _returned(hidden, traced[i].output if traced else None)
        return forward

    for i, block in enumerate(blocks):
        block.forward = stand_in(i)
    try:
        with moved_outside(model, arch.blocks, device), torch.inference_mode(), stop_at_head(model):
            for row in input_ids:
                calls.append({})
                try:
                    model(row.unsqueeze(0).to(device), use_cache=False)
                except StopForward:
                    pass
    finally:
        for block in blocks:
            del block.forward  # the class's forward again
    return BlockCalls(inputs, calls)


@contextmanager
def stop_at_head(model):
    """StopForward where the forward reaches the output projection: past a last block the text forward skips, the
    rest of the model is not needed either."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Module):
        yield
        return

    def stop(module, args):
        raise StopForward
    handle = head.register_forward_pre_hook(stop)
    try:
        yield
    finally:
        handle.remove()


def _returned(hidden, structure):
    """What a stand-in returns: the hidden states in the block's own output structure, Carried(k) for its k-th
    further element."""
    if structure is None:
        return hidden
    return tree_unflatten([hidden] + [Carried(k) for k in range(1, structure.num_leaves)], structure)


def _to(args: tuple, kwargs: dict, device):
    """(args, kwargs) with every tensor on `device`, a tensor passed to several places moved once."""
    moved = {}
    leaves, spec = tree_flatten((args, kwargs))
    out = [moved.setdefault(id(x), x.detach().to(device)) if isinstance(x, torch.Tensor) else x for x in leaves]
    return tree_unflatten(out, spec)


def _shared_with(previous, call):
    """`call` with each tensor equal to the previous sample's at the same place replaced by that one: the position
    embeddings and masks of windows of one length are the same in every sample, and are held once."""
    if previous is None:
        return call
    leaves, spec = tree_flatten(call)
    before, spec_before = tree_flatten(previous)
    if spec != spec_before:
        return call
    return tree_unflatten([b if _same(a, b) else a for a, b in zip(leaves, before)], spec)


def _same(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))


def trace_blocks(source, arch, device, vocab_size: int | None = None) -> list[BlockUses]:
    """BlockUses of every decoder block of `source` (quantkit.models.stream), from a forward of TRACE_TOKENS tokens;
    every expert of a split MoE layer computes every token, so each is seen. Blocks alike (the same modules and weight
    shapes) are used alike: only the first of each kind runs and is traced, the others stand in with their hidden
    states unchanged, so a model of sixty identical blocks reads one block's weights, not the model's. Where a block
    needs what an earlier one computed (Gemma's KV sharing, GLM-5's top-k indices) that fails, and every block runs.
    Fused experts the trace finds multiplied one expert at a time (kind "sliced") are split into linears
    (quantkit.models.sliced, in `source` itself) and the blocks traced again. A block weight the model's code uses
    outside the blocks' forward (OutsideUses) is kind "read" (in float)."""
    ids = (torch.arange(TRACE_TOKENS) % max((vocab_size or vocabulary(source.model.config)) - 1, 1) + 1).unsqueeze(0)
    touched = {}  # what the model's code does once (RWKV's rescale sets a flag) is kept over the traces
    traced = _trace_any(source, arch, device, ids, touched)
    sliced = [f"{arch.blocks}.{i}.{name}" for i, uses in enumerate(traced)
              for name, kind in uses.kinds.items() if kind == "sliced"]
    if not sliced:
        return traced
    source.split_sliced(sliced)
    return _trace_any(source, arch, device, ids, touched)


def _trace_any(source, arch, device, ids, touched) -> list[BlockUses]:
    try:
        return _trace(source, arch, device, ids, touched, one_of_a_kind=True)
    except QuantkitError:
        raise
    except Exception:  # noqa: BLE001 (whatever a stand-in's unchanged hidden states break, the full forward decides)
        return _trace(source, arch, device, ids, touched, one_of_a_kind=False)


def _kind_of(block) -> tuple:
    """What makes two blocks alike for the trace: their modules' classes and their parameters' shapes."""
    return tuple((name, type(m).__name__, tuple((k, tuple(p.shape)) for k, p in m.named_parameters(recurse=False)))
                 for name, m in block.named_modules())


def _trace(source, arch, device, ids, touched: dict, one_of_a_kind: bool) -> list[BlockUses]:
    model = source.model
    blocks = get_submodule(model, arch.blocks)
    uses, seen = {}, {}  # block index -> its BlockUses; block kind -> the index of the first block of that kind
    outside = OutsideUses(model, blocks, touched)

    def traced(i, block):
        prefix, forward, kind = f"{arch.blocks}.{i}", type(block).forward, _kind_of(block)

        def run(*args, **kwargs):
            outside.inside += 1
            try:
                if one_of_a_kind and kind in seen:
                    uses[i] = uses[seen[kind]]
                    out = _returned(args[0] if args else kwargs["hidden_states"], uses[i].output)
                else:
                    seen.setdefault(kind, i)
                    uses[i], out = _trace_block(source, prefix, block, forward, device, args, kwargs)
            finally:
                outside.inside -= 1
            if i == len(blocks) - 1:
                raise StopForward
            return out
        return run

    for i, block in enumerate(blocks):
        block.forward = traced(i, block)
    undo = source.load_outside(arch.blocks, device)
    try:
        with moved_outside(model, arch.blocks, device), torch.inference_mode(), outside, stop_at_head(model):
            try:
                model(ids.to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        undo()
        for block in blocks:
            del block.forward
    if not uses:  # a vision tower's blocks taken for the decoder's
        raise QuantkitError(f"a forward of text through the model ran none of the {len(blocks)} blocks at "
                            f"{arch.blocks}, the blocks quantkit found for its decoder: its decoder blocks are "
                            "elsewhere or run only on other inputs; this family needs a table entry "
                            "(quantkit/models/families.py)")
    traced = [_read_outside(uses[i], touched.get(i, ())) if i in uses else _never_run(block)
              for i, block in enumerate(blocks)]
    return [_float_kind(u, _shared_linears(blocks, i), "shared") for i, u in enumerate(traced)]


def _shared_linears(blocks, i: int) -> set[str]:
    """The linears of block i (names in it) whose weight another block holds too, one tensor (Zamba's shared
    attention block, tied into every hybrid layer)."""
    elsewhere = {id(p) for j, b in enumerate(blocks) if j != i for p in b.parameters()}
    return {n.rpartition(".")[0] for n, p in blocks[i].named_parameters(remove_duplicate=False) if id(p) in elsewhere}


def _never_run(block) -> BlockUses:
    """The uses of a block the model's forward skips on text (Mllama's cross-attention layers run only beside an
    image): every weight unused, so the block stays in float, and the calibration loop hands its inputs on."""
    return BlockUses(kinds={n: "experts" if p.dim() == 3 else "unused" for n, p in block.named_parameters()
                            if p.dim() >= 2 and p.is_floating_point()})


class OutsideUses(TorchFunctionMode):
    """Around a model's forward: the block parameters its own code uses outside every block's forward (`inside`
    counts the blocks running), as {block index: names in the block} in `touched`. RWKV's forward divides the
    attention.output and feed_forward.value weights of its blocks in place at its first eval call (fp16 headroom):
    a packed layer has no weight for that, so such linears stay in float (_read_outside), and the model's code does
    it again to the float weights when it runs. An in-place write is not carried out: the source's weights stay those
    of its files, which is what the checkpoint holds and what the blocks calibrate on (quantkit chains the blocks'
    outputs, so the model's rescaling between blocks is not applied either: the same function). Reads of what a
    tensor is (shape, dtype, device: a model's .device is its first parameter's) are no use."""

    def __init__(self, model, blocks, touched: dict):
        super().__init__()
        self.model, self.blocks, self.touched, self.inside, self.owner = model, blocks, touched, 0, {}

    def _owner(self, t):
        """(block index, name in the block) of a block parameter, None for another; the map is made again when a
        parameter is new to it (a streamed block's tensors are replaced as they load and release)."""
        if id(t) not in self.owner:
            self.owner = {id(p): None for p in self.model.parameters()}
            self.owner.update({id(p): (i, n) for i, b in enumerate(self.blocks) for n, p in b.named_parameters()})
        return self.owner.get(id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside or func in META_OPS:
            return func(*args, **kwargs)
        params = [o for x in tree_leaves((args, kwargs)) if isinstance(x, nn.Parameter) and (o := self._owner(x))]
        for i, name in params:
            self.touched.setdefault(i, set()).add(name)
        if params and _in_place(func):
            return args[0]
        return func(*args, **kwargs)


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in ("__iadd__", "__isub__", "__imul__",
                                                                          "__itruediv__", "__set__")


def _read_outside(uses: BlockUses, names) -> BlockUses:
    """`uses` with the linears whose weight the model's code uses outside the blocks (OutsideUses) as kind "read"."""
    return _float_kind(uses, {n.rpartition(".")[0] for n in names if n.endswith(".weight")}, "read")


def _float_kind(uses: BlockUses, modules, kind: str) -> BlockUses:
    """`uses` with those of `modules` that are its linears out of its stages, their weights of float `kind`."""
    modules = set(modules) & uses.linears
    if not modules:
        return uses
    stages = tuple(s for s in (tuple(n for n in stage if n not in modules) for stage in uses.stages) if s)
    return replace(uses, stages=stages, kinds={**uses.kinds, **{f"{m}.weight": kind for m in modules}})


def _trace_block(source, prefix, block, forward, device, args, kwargs):
    """(BlockUses, output) of one block's real forward, each weight read for the one call that uses it."""
    weights = [f"{prefix}.{n}" for n, p in block.named_parameters() if p.dim() > 1]
    loaded = source.load(prefix, skip=weights)  # norms, biases, buffers
    move_loaded(loaded, device)
    set_all_tokens(loaded, True)

    def materialize(name):
        full = f"{prefix}.{name}"
        return source.read([full], source.dtype)[full].to(device)
    try:
        with UseTrace(loaded, materialize) as trace:
            out = forward(loaded, *args, **kwargs)
        return replace(trace.result(), output=tree_flatten(out)[1]), out
    finally:
        set_all_tokens(loaded, False)
        move_loaded(loaded, "cpu")
        source.release(prefix)

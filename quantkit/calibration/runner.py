"""Forwarding the calibration samples through one block (or the head) and feeding its linears' inputs to observers.

BlockRunner forwards the samples one at a time on the compute device; observe() hooks the named linears and stops
each forward as soon as all of them have been fed. observe_stage accumulates each linear's statistics (the Hessian
X Xᵀ), once per distinct input; stage_results hands back each linear's result, quantized by one process or, under
torchrun, a share per process. The loops that use them: quantkit.calibration.sequential (the decoder blocks) and
quantkit.calibration.head (lm_head).
"""
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from quantkit.calibration.replay import ReplayedOutputs
from quantkit.core.errors import QuantkitError
from quantkit.core.finite import all_finite
from quantkit.models.arch import first_tensor, get_weight
from quantkit.models.moe import is_routed


class StopForward(Exception):
    pass


@dataclass(frozen=True)
class Carried:
    """Stands for element `index` of what the previous block returned, in a block's captured arguments
    (quantkit.calibration.capture): some decoders hand a block's further outputs to the next block (GLM-5's
    sparse-attention top-k indices); the calibration loop puts the previous block's real one in its place
    (BlockRunner.previous)."""
    index: int


@contextmanager
def input_hooks(block: nn.Module, names, sink: Callable[[str, torch.Tensor], None]):
    """While active, every call of block.<name> first passes its input to sink(name, x)."""
    handles = []
    for name in names:
        module = block.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda m, args, n=name: sink(n, args[0].detach())))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _outputs_not_computed(block: nn.Module, names):
    """While active, the named linears return zeros of their output shape instead of computing it."""
    modules = [block.get_submodule(n) for n in names]
    for m in modules:
        m.forward = lambda x, *args, n_out=get_weight(m).shape[0], **kwargs: x.new_zeros(*x.shape[:-1], n_out)
    try:
        yield
    finally:
        for m in modules:
            del m.forward  # the class's forward again


class BlockRunner:
    """Forwards the calibration samples through one block on the compute device. calls: per sample, the block's
    other arguments (positional after the hidden states, keyword) as the model passes them
    (quantkit.calibration.capture.BlockCalls.of_block), or one (args, kwargs) for every sample."""

    def __init__(self, block, inputs, calls, device, store_device="cpu", feeds_only=()):
        self.block, self.inputs, self.device = block, inputs, device
        self.calls = calls if isinstance(calls, list) else [calls] * len(inputs)
        self.previous = None  # per sample, the previous block's further outputs (what a Carried argument stands for)
        self._on_device = {}  # id of a stored tensor -> its copy on the compute device (shared ones moved once)
        self.replayed = ReplayedOutputs(block, device, store_device, len(inputs), feeds_only)

    def call(self, i: int, x):
        """The block on sample i's input x with sample i's other arguments."""
        args, kwargs = self.calls[i]
        leaves, spec = tree_flatten((args, kwargs))
        leaves = [self.previous[i][t.index] if isinstance(t, Carried) else t for t in leaves]
        moved = [self._device_copy(t) if isinstance(t, torch.Tensor) else t for t in leaves]
        args, kwargs = tree_unflatten(moved, spec)
        return self.block(x, *args, **kwargs)

    def _device_copy(self, t):
        if t.device == torch.device(self.device):
            return t
        if id(t) not in self._on_device:
            self._on_device[id(t)] = (t, t.to(self.device))  # t held: its id stays its own
        return self._on_device[id(t)][1]

    def _samples(self, indices=None):
        """The inputs (all, or those at `indices`) on the compute device, one at a time (the replayed outputs
        follow the sample)."""
        for i in range(len(self.inputs)) if indices is None else indices:
            self.replayed.sample = i
            yield self.inputs[i].to(self.device)

    def forward_all(self, keep_outputs=False, store_device="cpu", name="block"):
        """Outputs (when kept) checked finite: `name` says which block overflowed. The block's final forward: it
        consumes the replayed outputs. The block's further outputs per sample (for the next block's Carried
        arguments) are left in self.returned."""
        outs, self.returned = [], []
        with torch.inference_mode(), self.replayed.active(consume=True):
            for i, x in enumerate(self._samples()):
                out = self.call(i, x)
                y, *further = tree_flatten(out)[0]
                if not isinstance(y, torch.Tensor):  # an output object of its own
                    y, further = first_tensor(out), []
                if keep_outputs:
                    outs.append(check_activations(y.detach(), f"the outputs of {name}").to(store_device))
                    self.returned.append([None] + [t.to(store_device) if isinstance(t, torch.Tensor) else t
                                                   for t in further] if further else None)
        return outs

    def observe(self, names, sink: Callable[[str, torch.Tensor, str], None], parallel=False, samples=None) -> None:
        """Per sample, sink(name, x, source) gets the input x of every named linear, `source` being the first
        of them that was fed the very same tensor (q/k/v read one normed input: a sink accumulates it once).
        A sample's forward stops as soon as all of them have been fed: the modules after them (the MLP
        while observing q/k/v, and the last of the named linears) are never computed. parallel: no named
        linear's input depends on another's output (a true-sequential stage), so they are not computed at all
        (zeros stand in for their outputs: gate_proj ran in full before up_proj was reached). samples: the indices
        of the samples to forward (default all)."""
        fed = {}  # this sample: name -> its input (held, so no later tensor can reuse the address)
        seen = set()  # over all samples

        def hook(name, x):
            same = (x.data_ptr(), x.shape, x.stride())
            source = next((n for n, y in fed.items() if (y.data_ptr(), y.shape, y.stride()) == same), name)
            fed[name] = x
            last = len(fed) == len(names)
            self.replayed.fed(name, x, last)
            sink(name, x, source)
            if last:
                raise StopForward

        skipped = _outputs_not_computed(self.block, names) if parallel else contextlib.nullcontext()
        with torch.inference_mode(), input_hooks(self.block, names, hook), skipped, self.replayed.active():
            for i, x in zip(range(len(self.inputs)) if samples is None else samples, self._samples(samples)):
                fed.clear()
                try:
                    self.call(i, x)
                except StopForward:
                    pass
                seen.update(fed)
        missing = [n for n in names if n not in seen and not is_routed(self.block, n)]  # an expert may get none
        if missing:
            raise QuantkitError(f"the block never calls {', '.join(missing)} in its forward: nothing to calibrate "
                                "it on; skip it in the recipe (modules: ... skip: true)")

    def capture(self, names, samples=None) -> dict[str, torch.Tensor]:
        """Inputs of the named linears over all samples (or those at `samples`), as [tokens, in] on the compute
        device."""
        got = {n: [] for n in names}
        self.observe(names, lambda n, x, source: got[n].append(x.reshape(-1, x.shape[-1])), samples=samples)
        return {n: torch.cat(v) for n, v in got.items() if v}  # a routed expert no sample reached has none


def check_activations(x: torch.Tensor, where: str) -> torch.Tensor:
    if not all_finite(x):  # runs on every block output of every sample
        raise QuantkitError(f"calibration activations are NaN/Inf at {where} ({x.dtype}): the model overflows on "
                            "this data; quantize with --dtype float32, or check the calibration text")
    return x


def stage_results(names, quantize_one, group):
    """(name, result) in stage order. One process: each linear quantized when its turn comes (one layer's codes
    held at a time). Under torchrun: each process first quantizes its own share (at the same time as the others),
    then every result is sent from its owner to all."""
    if not group.active:
        for n in names:
            yield n, quantize_one(n)
        return
    own = {n: quantize_one(n) for j, n in enumerate(names) if group.owner(j) == group.rank}
    for j, n in enumerate(names):
        yield n, group.broadcast(own.pop(n, None), group.owner(j))


def observe_stage(runner, names, observers, parallel=False) -> None:
    """Accumulate each linear's input statistics; linears fed one tensor share the first one's (once)."""
    shared = {}

    def sink(name, x, source):
        if source == name:
            observers[name].add_batch(x)
        else:
            shared[name] = source

    runner.observe(names, sink, parallel)
    for name, source in shared.items():
        observers[name].share_statistics(observers[source])

"""What a block's later calibration passes need not compute again: submodule outputs replayed from recordings.

True-sequential calibration forwards each block once per stage (q/k/v, o, gate/up, down) and once more with all its
weights quantized. Much of that recomputes values that can no longer change. Two recordings, per submodule named in
Arch.reusable (the attention, the MLP) together with its output linear (o_proj, down_proj):

- its output linear's input ("tail input"): once the submodule's other linears are quantized, the input of its
  output linear is final; the pass that observes that linear records it. After the linear is quantized too, the
  submodule's output is that linear applied to the recording: the attention's projections and core, or the MLP's
  gate/up, are not run again. Recorded on the compute device, and only where they fit a quarter of its free memory
  (the MLP's are tokens x intermediate size).
- its output: once everything in the submodule is final and a later pass remains, the next pass records what it
  returns per sample; later passes return a copy (the block may add to it in place), the last one the recording.

The block's final forward consumes both (each sample's recordings are dropped once replayed), so the block's outputs
take their place and peak memory does not grow. A module whose output only the replayed submodule reads
(Arch.feeds_only: the norm before it) then returns its input unchanged instead of computing what nobody reads.
Replaying returns exactly what recomputing would: the same modules on the same inputs, bit for bit. A Llama block
ran its attention in four passes and its MLP's gate/up in two; with the replays, the attention runs in one and a
sample, the gate/up in one and a sample (the first replayed sample runs the submodule for real, to learn how it wraps
its output linear's result); the norm in front of each runs only where its output is read.
"""
from contextlib import contextmanager
from typing import Callable, Optional

import torch
from torch import nn


class _Recorded:
    """One reusable submodule's recordings and whether they may be replayed yet."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.tail: Optional[nn.Module] = None     # its output linear, while or once its input is recorded
        self.tail_name: Optional[str] = None
        self.tail_inputs: dict[int, torch.Tensor] = {}  # sample -> the output linear's input
        self.recording_tail = False
        self.tail_final = False                  # output = tail(tail input) from now on
        self.rebuild: Optional[Callable] = None  # tail's output -> the submodule's output (learnt on first use)
        self.outputs: Optional[dict[int, object]] = None  # sample -> output, once final (None: not recorded)

    @property
    def replays(self) -> bool:
        return self.tail_final or self.outputs is not None

    def needs_no_input(self, i: int) -> bool:
        """Sample i's output comes from a recording alone (its recorded output, or its tail through a known rebuild)."""
        return ((self.outputs is not None and i in self.outputs)
                or (self.tail_final and self.rebuild is not None and i in self.tail_inputs))


class ReplayedOutputs:
    """The recordings of one block's reusable submodules (see the module docstring). The calibration loop calls
    record_tail(submodule, linear) before the pass that observes the submodule's output linear, fed(linear, x) from
    that pass's input hooks, and final(submodule, ...) once every linear in the submodule is quantized; each pass
    runs inside active()."""

    def __init__(self, block: nn.Module, device, store_device, n_samples: int, feeds_only=()):
        self.block, self.device, self.store_device, self.n_samples = block, device, store_device, n_samples
        self.feeds_only = feeds_only  # (module, submodule): the module's output is read by the submodule alone
        self.recorded: dict[str, _Recorded] = {}
        self.sample = 0  # the sample being forwarded (BlockRunner sets it)

    def _entry(self, name: str) -> _Recorded:
        if name not in self.recorded:
            self.recorded[name] = _Recorded(self.block.get_submodule(name))
        return self.recorded[name]

    @property
    def outputs(self) -> dict[str, dict]:
        """{submodule: {sample: recorded output}} of those whose outputs are recorded."""
        return {name: r.outputs for name, r in self.recorded.items() if r.outputs is not None}

    def record_tail(self, name: str, linear: str) -> None:
        """The next pass observes `linear`, the output linear of submodule `name`, whose other linears are final:
        record its input."""
        r = self._entry(name)
        r.tail, r.tail_name, r.recording_tail = self.block.get_submodule(linear), linear, True

    def fed(self, linear: str, x: torch.Tensor, last: bool = False) -> None:
        """An observed linear's input: kept where it is a tail being recorded (and all samples' fit the budget).
        last: the pass stops at this input, so nothing computes on x again: x itself is kept where it is a compact
        tensor on the compute device (a copy otherwise; the copies were 1 % of a SmolLM2 GPTQ run)."""
        for r in self.recorded.values():
            if r.recording_tail and r.tail_name == linear:
                if not r.tail_inputs and x.numel() * x.element_size() * self.n_samples > free_bytes(self.device) // 4:
                    r.recording_tail = False  # would not fit: the submodule is computed as before
                    continue
                r.tail_inputs[self.sample] = x if last and _compact_on(x, self.device) else x.to(self.device, copy=True)

    def final(self, name: str, record_outputs: bool = True) -> None:
        """Every linear of submodule `name` is quantized and its input final: replay its tail from now on, and
        record its outputs in the next pass when a later pass remains to replay them (record_outputs)."""
        r = self._entry(name)
        r.recording_tail = False
        r.tail_final = r.tail is not None and len(r.tail_inputs) == self.n_samples
        if not r.tail_final:
            r.tail_inputs.clear()  # a partial recording (the stage stopped early, or the budget): not used
        if record_outputs:
            r.outputs = {}

    @contextmanager
    def active(self, consume=False):
        """consume: the last pass; replay and drop, record nothing."""
        replaying = [r for r in self.recorded.values() if r.replays]
        unread = [(self.block.get_submodule(m), self.recorded[sub]) for m, sub in self.feeds_only
                  if sub in self.recorded and self.recorded[sub].replays]
        for r in replaying:
            r.module.forward = self._replaying(r, r.module.forward, consume)
        for module, r in unread:
            module.forward = self._unless_read(r, module.forward)
        try:
            yield
        finally:
            for module in [r.module for r in replaying] + [m for m, _ in unread]:
                del module.forward  # the class's forward again

    def _unless_read(self, r: _Recorded, compute):
        """The forward of a module feeding r alone: skipped (its input passed on) where r does not read it."""
        def forward(*args, **kwargs):
            if r.needs_no_input(self.sample):
                return args[0] if args else next(iter(kwargs.values()))
            return compute(*args, **kwargs)
        return forward

    def _replaying(self, r: _Recorded, compute, consume: bool):
        def forward(*args, **kwargs):
            i = self.sample
            if r.outputs is not None and i in r.outputs:
                if consume:  # the last reader: the recording itself
                    return to_device(r.outputs.pop(i), self.device)
                return to_device(r.outputs[i], self.device, copy=True)  # the block may add to it in place
            recording = r.outputs is not None and not consume
            out = self._from_tail(r, i, compute, args, kwargs, drop=consume or recording)
            if recording:
                r.outputs[i] = to_device(out, self.store_device, copy=True)
            return out
        return forward

    @staticmethod
    def _from_tail(r: _Recorded, i: int, compute, args, kwargs, drop: bool):
        """The submodule's output from its recorded tail input (drop: the recording is not needed after this)."""
        if not (r.tail_final and i in r.tail_inputs):
            return compute(*args, **kwargs)
        x = r.tail_inputs.pop(i) if drop else r.tail_inputs[i]
        if r.rebuild is not None:
            return r.rebuild(r.tail(x))
        # First use: run it for real and see how its output wraps the tail's result
        seen = []
        handle = r.tail.register_forward_hook(lambda m, a, y: seen.append(y))
        try:
            out = compute(*args, **kwargs)
        finally:
            handle.remove()
        r.rebuild = _rebuilder(out, seen[-1]) if seen else None
        if r.rebuild is None:  # it post-processes the result: always computed
            r.tail_final = False
            r.tail_inputs.clear()
        return out


def _rebuilder(out, y) -> Optional[Callable]:
    """How `out` wraps its output linear's result `y`: y itself, or a tuple/list of y then Nones (attention
    weights not computed); None for anything else (the result transformed, or more outputs)."""
    if out is y:
        return lambda t: t
    if type(out) in (tuple, list) and out and out[0] is y and all(o is None for o in out[1:]):
        kind, n = type(out), len(out)
        return lambda t: kind((t,) + (None,) * (n - 1))
    return None


def free_bytes(device) -> int:
    """Memory free for new tensors on `device` (a GPU's, or the host's available memory); 0 when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _compact_on(x: torch.Tensor, device) -> bool:
    """x is contiguous on `device` and its storage holds nothing else (keeping it keeps no larger buffer alive)."""
    return (x.device == torch.device(device) and x.is_contiguous()
            and x.untyped_storage().nbytes() == x.numel() * x.element_size())


def to_device(v, device, copy=False):
    if isinstance(v, torch.Tensor):
        return v.to(device, copy=copy)
    if isinstance(v, tuple):
        return tuple(to_device(t, device, copy) for t in v)
    return v

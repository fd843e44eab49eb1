"""Run a model whose largest parts stay on disk: each decoder block, and an untied output head, reads its tensors
from the safetensors files when its forward starts and lets them go when it returns.

For models larger than memory. Peak memory is what stays resident (the input embedding, norms, rotary tables)
plus the largest streamed unit (one block, or the head) and the activations, whatever the number of blocks; the
price is that every forward reads the streamed tensors again: from the OS page cache when the files fit there,
from disk otherwise. safetensors hands out memory-mapped views, so a quantized block's packed tensors are file
pages that are dropped with the view, and only the floating tensors cast to the compute dtype are copies.

The input embedding stays resident because transformers finds a model's device from its first parameter (the
embedding), and generate() puts its inputs there.

Used by load_quantized(stream=True) and by `quantkit eval perplexity --stream` for floating-point models.
"""
from functools import partial

import torch
from torch import nn

from quantkit.core.errors import QuantkitError
from quantkit.core.memory import return_freed_memory


class _Slot:
    """One tensor attribute of a streamed unit: where it lives, what it looks like, where it is stored."""

    def __init__(self, owner: nn.Module, leaf: str, stored_as: str):
        t = getattr(owner, leaf)
        self.owner, self.leaf, self.stored_as = owner, leaf, stored_as
        self.is_param = leaf in owner._parameters
        self.shape, self.dtype = t.shape, t.dtype

    def put(self, t: torch.Tensor) -> None:
        if self.is_param:
            self.owner._parameters[self.leaf] = nn.Parameter(t, requires_grad=False)
        else:
            self.owner._buffers[self.leaf] = t

    def drop(self) -> None:
        self.put(torch.empty(self.shape, dtype=self.dtype, device="meta"))


def stored_names(model: nn.Module, available) -> dict:
    """{attribute path: the name it is stored under}: tied tensors (lm_head.weight sharing the embedding) map to
    the one name in `available`, the set of tensor names the files hold."""
    groups = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        groups.setdefault(id(t), []).append(name)
    out = {}
    for names in groups.values():
        stored = next((n for n in names if n in available), None)
        if stored is not None:
            out.update({n: stored for n in names})
    return out


def streamed_units(model: nn.Module, blocks_path: str) -> list[str]:
    """The decoder blocks, and the output head when it is not the input embedding (tied heads stay resident)."""
    units = [f"{blocks_path}.{i}" for i in range(len(model.get_submodule(blocks_path)))]
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and getattr(head, "weight", None) is not embedding.weight:  # a quantized head has none
        units.append(next(n for n, m in model.named_modules() if m is head))
    return units


def stream_units(model: nn.Module, units, read, stored: dict, device="cpu") -> None:
    """Make every module in `units` (paths) load its tensors on entry to its forward and drop them on exit.

    read(names) -> {stored name: tensor} (any dtype: floating tensors are cast to the dtype the skeleton gives
    them, the others kept as stored); stored: from stored_names. The units' tensors are dropped now (made meta).
    """
    for path in units:
        unit = model.get_submodule(path)
        slots = []
        for mod_name, owner in unit.named_modules():
            full = f"{path}.{mod_name}" if mod_name else path
            for leaf, t in list(owner._parameters.items()) + list(owner._buffers.items()):
                if t is not None and f"{full}.{leaf}" in stored:
                    slots.append(_Slot(owner, leaf, stored[f"{full}.{leaf}"]))
                elif t is not None and t.is_meta:
                    raise QuantkitError(f"tensor {full}.{leaf} is not in the model's files: they are incomplete "
                                        "(copy them again, or quantize again)")
        for m in unit.modules():  # a decoded-weight cache (QuantLinear on CPU) would outlive the packed tensors
            if hasattr(m, "cache_dequantized"):
                m.cache_dequantized = False
        unit.register_forward_pre_hook(partial(_load, slots, read, device))
        unit.register_forward_hook(partial(_drop, slots), always_call=True)
        _drop(slots)


def _load(slots, read, device, module, args):
    tensors = read(sorted({s.stored_as for s in slots}))
    for s in slots:
        t = tensors[s.stored_as]
        s.put(t.to(device=device, dtype=s.dtype if t.is_floating_point() else t.dtype))


def _drop(slots, *hook_args):
    for s in slots:
        s.drop()
    return_freed_memory()  # glibc would keep the freed block's heap pages: resident memory would grow per block


def stream_model(model: nn.Module, blocks_path: str, read, available, device="cpu") -> list[str]:
    """Stream `model`'s decoder blocks and untied head (see the module doc); returns the unit paths. The caller
    loads every other tensor; `available` is the set of names the files hold, read(names) as in stream_units."""
    model.tie_weights()  # a skeleton built on meta may not be tied yet; a tied head must stay resident
    units = streamed_units(model, blocks_path)
    stream_units(model, units, read, stored_names(model, available), device)
    return units


def under(name: str, units) -> bool:
    return any(name.startswith(u + ".") for u in units)

"""Where a model's tensors go.

move_loaded: the real tensors of a partly meta model (a streamed one, whose tensors load on first use) onto a device,
as calibration, load_quantized and evaluation move them.

place_on_gpus: a loaded model's decoder blocks spread over several GPUs, for load_quantized(device_map="auto") when
the model does not fit on one GPU, device_map="balanced" always. The modules outside the blocks (embeddings, final
norm, rotary tables, lm_head, tied to the embeddings in many models) go to the first GPU; the blocks follow in
order, each GPU taking about an equal share of the bytes and never more than HEADROOM of its free memory.
accelerate's dispatch_model (what transformers' own device_map="auto" uses) hooks every placed module to move its
inputs to its GPU; the kernels launch on their tensors' GPU (quantkit.kernels.device). The map is kept as
model.hf_device_map, as transformers does.
"""
import torch
from torch import nn

from quantkit.core.errors import QuantkitError

HEADROOM = 0.85  # of a GPU's free memory for the weights: the rest for activations and the KV cache
GiB = 1 << 30


def move_loaded(module: nn.Module, device, recurse=True) -> None:
    """module.to(device) for a partly meta module (streamed): moves the real tensors in place (tied ones once,
    ties kept), leaves the meta placeholders."""
    mods = module.modules() if recurse else [module]
    for m in mods:
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and not t.is_meta and t.device != torch.device(device):
                t.data = t.data.to(device)


def tensor_bytes(module: nn.Module) -> int:
    """Parameters and buffers (QuantLinear's packed tensors are buffers), shared ones once."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def outside_modules(model: nn.Module, blocks_path: str) -> list[str]:
    """The children along the path to the blocks, less that path: model.embed_tokens, model.norm, model.rotary_emb
    and lm_head for blocks at model.layers."""
    parts, names = blocks_path.split("."), []
    for depth in range(len(parts)):
        parent = ".".join(parts[:depth])
        for child, _ in model.get_submodule(parent).named_children():
            full = f"{parent}.{child}" if parent else child
            if full != ".".join(parts[:depth + 1]):
                names.append(full)
    return names


def assign_blocks(outside: int, blocks: list, budgets: list) -> list:
    """The GPU index of each block (sizes in bytes, in order): the outside modules on GPU 0, then about an equal
    share of all bytes per GPU, none over its budget."""
    total, n = outside + sum(blocks), len(budgets)
    if outside > budgets[0] or total > sum(budgets):
        raise QuantkitError(f"the model needs {total / GiB:.1f} GiB but the {n} GPUs offer "
                            f"{sum(budgets) / GiB:.1f} GiB for weights ({HEADROOM:.0%} of what is free): free some "
                            "GPU memory, or load with stream=True (one block at a time, slower)")
    share, used, gpu, where = total / n, [outside] + [0] * (n - 1), 0, []
    for size in blocks:
        # on to the next GPU once this one is full, or has its share (a block goes where most of it fits the share)
        while gpu < n - 1 and (used[gpu] + size > budgets[gpu] or used[gpu] + size / 2 > share):
            gpu += 1
        if used[gpu] + size > budgets[gpu]:
            raise QuantkitError(f"the model's blocks do not fit the free memory of the {n} GPUs in order (block "
                                f"{len(where)} needs {size / GiB:.2f} GiB more on cuda:{gpu}): free some GPU memory, "
                                "or load with stream=True")
        used[gpu] += size
        where.append(gpu)
    return where


def free_budgets() -> list:
    return [int(torch.cuda.mem_get_info(i)[0] * HEADROOM) for i in range(torch.cuda.device_count())]


def spread(model: nn.Module, blocks_path: str, devices: list, budgets: list) -> nn.Module:
    """Place the model over `devices` (names, one budget in bytes each) and hook it; returns it."""
    from accelerate import dispatch_model

    blocks = model.get_submodule(blocks_path)
    outside = outside_modules(model, blocks_path)
    where = assign_blocks(sum(tensor_bytes(model.get_submodule(n)) for n in outside),
                          [tensor_bytes(b) for b in blocks], budgets)
    device_map = {name: devices[0] for name in outside}
    device_map.update({f"{blocks_path}.{i}": devices[g] for i, g in enumerate(where)})
    # force_hooks: the hooks also when every entry names one device (the CPU tests); skip_keys: the KV cache
    # object travels as it is, each layer's tensors on its own GPU (what transformers passes too)
    model = dispatch_model(model, device_map, main_device=devices[0], force_hooks=True,
                           skip_keys=getattr(model, "_skip_keys_device_placement", None))
    model.hf_device_map = device_map
    return model


def place_on_gpus(model: nn.Module, blocks_path: str, always: bool) -> nn.Module:
    """device_map "auto" (always=False): one GPU when the model fits its budget, else all visible GPUs;
    "balanced" (always=True): all visible GPUs."""
    budgets = free_budgets()
    if len(budgets) < 2 or (not always and tensor_bytes(model) <= budgets[0]):
        return model.to("cuda")
    return spread(model, blocks_path, [f"cuda:{i}" for i in range(len(budgets))], budgets)

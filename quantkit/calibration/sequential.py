"""The sequential block loop shared by every calibrated method (GPTQ, AWQ, AWQ+GPTQ).

1. capture what every block receives (block 0's hidden states, and each block's own other arguments: masks and
   position embeddings of its attention type, per-layer inputs; cache off) by running the model's own decoder loop
   with stand-ins for the blocks (quantkit.calibration.capture);
2. for each block: move it to the compute device, let the method prepare it (AWQ scales), then per
   true-sequential stage: hook the stage's linears, forward the calibration samples, quantize them
   and write the quantized weights back; finally forward again with the quantized weights: those
   outputs are the next block's inputs (so later blocks calibrate on what they will really see).
Only the current block sits on the compute device; calibration activations live on `store_device`.
The model may be a streamed skeleton (quantkit.models.stream): each block is loaded from the source shards
when its turn comes and released after it is written, so only one block is ever held.
"""
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from quantkit.calibration.capture import capture_block_calls
from quantkit.calibration.distributed import SINGLE
from quantkit.calibration.head import calibrated_head, data_free_head
from quantkit.calibration.replay import free_bytes
from quantkit.calibration.runner import BlockRunner, observe_stage, stage_results
from quantkit.core.errors import QuantkitError
from quantkit.core.matmul import onednn_linears
from quantkit.core.units import size_text
from quantkit.models.arch import (Arch, block_linears, for_block, get_submodule, get_weight,  # noqa: F401 (re-exported)
                                  set_weight)
from quantkit.models.moe import expert_of, set_all_tokens


def check_activation_memory(model_config, shape: tuple[int, int], dtype: torch.dtype, store_device) -> None:
    """Refuse at once a calibration of `shape` (samples, tokens each) whose stored activations alone exceed the free
    memory of `store_device`: a block's inputs and outputs for every sample (2 x tokens x hidden) are held there
    together, and past the host's available memory the kernel's OOM killer ends the run without a word (its
    finished blocks kept for --resume)."""
    hidden, free = getattr(model_config, "hidden_size", None), free_bytes(store_device)
    if not isinstance(hidden, int) or free == 0:
        return  # unknown: nothing to say in advance
    width = torch.finfo(dtype).bits // 8
    need = 2 * shape[0] * shape[1] * hidden * width
    if need > free:
        raise QuantkitError(f"the calibration activations need {size_text(need)} ({shape[0]} x {shape[1]} tokens x "
                            f"hidden size {hidden} x {width} bytes, a block's inputs and outputs) but {size_text(free)} "
                            "are free: use fewer --nsamples or a shorter --seqlen")


def calibrated_blocks(source, arch: Arch, input_ids, method, device, true_sequential=True, store_device="cpu",
                      start=0, replay=None, on_result=None, group=None, head=None, traced=None):
    """Quantize the blocks of `source` (quantkit.models.stream) in order, yielding (index, block, its results)
    while the block is still loaded (its norms may carry AWQ's folded scales, to be written).

    `method` provides: prepare_block(runner, block, prefix) (may rescale weights, e.g. AWQ),
    names(block_prefix, stage) -> the names in the stage it quantizes,
    observer(full_name, weight) -> object with add_batch(x), and
    quantize(full_name, observer, module) -> QuantResult.
    Blocks before `start` (--resume) are not quantized again: replay(i) rebuilds block i as it was written
    (decoded weights), and it is only forwarded, to produce the next block's inputs.
    on_result(full_name, result) -> result, if given, sees each layer's result as soon as its quantized weight is
    in place, and what it returns is kept instead (the writer packs the codes there and keeps a summary, so a
    block's int32 codes are never all held at once).
    group (quantkit.calibration.distributed.Group, under torchrun): this process calibrates on its share of the samples, the
    statistics are summed over the processes and the linears of each stage quantized a share per process.
    head (quantkit.models.head.HeadPaths, --lm-head): lm_head is quantized after the last block, on the final norm of
    its outputs, and yielded as (number of blocks, None, its results); with start past the last block it is done.
    traced: each block's BlockUses (quantkit.calibration.capture.trace_blocks): the linears it quantizes are those its
    forward multiplies as linear layers (None: the family table's, or every linear of a family found by shape).
    """
    group = group or SINGLE
    model = source.model
    blocks = get_submodule(model, arch.blocks)
    input_ids = group.split(input_ids)
    check_activation_memory(model.config, tuple(input_ids.shape[:2]), source.dtype, store_device)
    undo = source.load_outside(arch.blocks, device)  # embeddings etc. load on first use
    try:
        captured = capture_block_calls(model, arch, input_ids, device, store_device, traced)
    finally:
        undo()
    inputs, returned = captured.inputs, None
    for i in tqdm(range(len(blocks)), desc="blocks", unit="block", disable=not group.is_writer):
        prefix = f"{arch.blocks}.{i}"
        block = replay(i) if i < start else source.load(prefix)
        calls = captured.of_block(i)
        if calls is None:  # the model's forward skips it on text (Mllama's cross-attention layers): it stays in
            results = {}   # float, and its inputs go on to the next block unchanged, as in the model's forward
        else:
            block.to(device)
            with onednn_linears(block):  # on a CPU with AVX-512: the block's float32 products at twice BLAS's speed
                here = for_block(arch, block, traced[i] if traced else None)  # DeepSeek's dense and MoE blocks differ
                runner = BlockRunner(block, inputs, calls, device, store_device, here.feeds_only)
                runner.previous, returned = returned, None  # the previous block's further outputs, where it has some
                set_all_tokens(block, method.config.moe_calibration == "all")  # the experts' statistics (moe.py)
                stages = here.sequential if true_sequential else (tuple(n for s in here.sequential for n in s),)
                results = {} if i < start else _quantize_block(runner, block, prefix, method, stages, here.reusable,
                                                               on_result, group, parallel=not here.found_by_shape)
                set_all_tokens(block, False)  # the next block's inputs: the routed forward, the same outputs sooner
                inputs = runner.forward_all(keep_outputs=True, store_device=store_device, name=prefix)
                returned = runner.returned
            block.to("cpu")
        if i >= start:
            yield i, block, results
        source.release(prefix)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if head is not None and start <= len(blocks):
        yield len(blocks), None, calibrated_head(source, head, inputs, method, device, store_device, on_result, group)


def _quantize_block(runner, block, prefix, method, stages, reusable, on_result, group, parallel=True) -> dict:
    """Each stage: observe its linears' inputs, quantize them, put the quantized weights in place (under torchrun:
    statistics summed over the processes, each linear quantized by one of them and sent to all). Around it, what
    the later passes may replay (quantkit.calibration.replay): a reusable submodule's output linear has its input
    recorded when its stage is observed after the submodule's other linears, and a submodule whose last linear
    this stage quantized is final (its tail replayed, its outputs recorded while later stages remain). parallel: the
    stages are the table's, whose linears never feed one another (a family found by shape has stages from a trace,
    and its linears are computed while observed, whatever the trace missed)."""
    method.prepare_block(runner, block, prefix)
    results = {}
    for s, stage in enumerate(stages):
        for name, tail in _tails_observed_in(reusable, stages, s):
            runner.replayed.record_tail(name, tail)
        results.update(_quantize_stage(runner, block, prefix, method, stage, parallel and len(stages) > 1, on_result,
                                       group))
        for name, _ in reusable:
            linears = _stages_of(name, stages)
            if linears and max(linears.values()) == s:
                runner.replayed.final(name, record_outputs=s + 1 < len(stages))
    return results


def _stages_of(submodule: str, stages) -> dict[str, int]:
    """{linear: index of its stage} for the submodule's linears."""
    return {n: i for i, stage in enumerate(stages) for n in stage if n.startswith(submodule + ".")}


def _tails_observed_in(reusable, stages, s: int) -> list:
    """(submodule, output linear) pairs whose output linear stage s observes after all the submodule's other linears
    were quantized (so its input is final): stages follow the data flow."""
    out = []
    for name, tail in reusable:
        linears = _stages_of(name, stages)
        if linears.get(tail) == s and all(i < s for n, i in linears.items() if n != tail):
            out.append((name, tail))
    return out


def _quantize_stage(runner, block, prefix, method, stage, parallel, on_result, group) -> dict:
    """parallel: one of several true-sequential stages, whose linears are fed from one point of the block
    (Arch.sequential), never from each other: they need not be computed while observed."""
    names = method.names(prefix, stage)
    if not names:
        return {}
    observers = {n: method.observer(f"{prefix}.{n}", get_weight(block.get_submodule(n))) for n in names}
    with routed_tokens(block, names, observers, group):
        observe_stage(runner, names, observers, parallel)
    group.reduce_statistics([observers[n] for n in names])

    def quantize_one(n):
        try:
            return method.quantize(f"{prefix}.{n}", observers.pop(n), block.get_submodule(n))
        except QuantkitError as e:
            raise QuantkitError(f"{prefix}.{n}: {e}") from e

    results = {}
    for n, res in stage_results(names, quantize_one, group):
        set_weight(block.get_submodule(n), res.dequantize())
        results[f"{prefix}.{n}"] = on_result(f"{prefix}.{n}", res) if on_result else res
        del res  # its codes, before the next layer's are made
    return results


@contextmanager
def routed_tokens(block, names, observers, group=SINGLE):
    """While a stage is observed, count the tokens the router sends to each of its routed experts: set as each of
    their observers' routed_tokens (with --moe-calibration all an expert's Hessian also sees the others').
    Under torchrun each process counts its share of the samples and the counts are summed over the processes."""
    experts = {n: e for n in names if (e := expert_of(block, n)) is not None}
    modules = {id(m): m for m, _ in experts.values()}
    for m in modules.values():
        m.routed_counts = torch.zeros(len(m), dtype=torch.long)
    try:
        yield
        for m in modules.values():  # every process holds the same modules, in the same order
            group.sum_counts(m.routed_counts)
        for n, (m, index) in experts.items():
            observers[n].routed_tokens = int(m.routed_counts[index])
    finally:
        for m in modules.values():
            m.routed_counts = None


def data_free_blocks(source, arch: Arch, method, start=0, on_result=None, head=None, traced=None):
    """RTN-style methods: each block's linears rounded one at a time, yielded, released; no activations.
    Only one quantized linear's weight is loaded at a time (the block's other tensors stay loaded for the writer);
    on_result, head and traced as in calibrated_blocks."""
    blocks = get_submodule(source.model, arch.blocks)
    for i in tqdm(range(start, len(blocks)), desc=method.config.method, unit="block", initial=start,
                  total=len(blocks)):
        prefix = f"{arch.blocks}.{i}"
        names = [f"{prefix}.{n}" for n in block_linears(arch, blocks[i], traced[i] if traced else None)
                 if method.spec(f"{prefix}.{n}") is not None]
        weights = [f"{n}.weight" for n in names]
        block = source.load(prefix, skip=weights)
        results = {}
        for name, weight in zip(names, weights):
            source.load_names([weight])
            res = method.quantize(name, None, source.model.get_submodule(name))
            source.release_names([weight])
            results[name] = on_result(name, res) if on_result else res
            del res  # its codes, before the next layer's are made
        yield i, block, results
        source.release(prefix)
    if head is not None and start <= len(blocks):
        yield len(blocks), None, data_free_head(source, head, method, on_result)

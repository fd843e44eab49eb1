"""lm_head quantized after the last decoder block (--lm-head), like one more block of one linear.

Its calibration inputs are the final norm of the last block's outputs, the blocks already quantized: what lm_head
reads in the quantized model. The forward stops at lm_head's input, so the logits ([tokens, vocab]) are never
computed. A tied lm_head (SmolLM2, Llama-3.2-1B) is read from the embedding's stored tensor and set on lm_head
alone: the checkpoint then holds the embedding in float and lm_head quantized, untied (config.json says so).
"""
import torch

from quantkit.calibration.distributed import SINGLE
from quantkit.calibration.runner import BlockRunner, observe_stage, stage_results
from quantkit.models.arch import get_weight
from quantkit.models.head import Head, HeadPaths
from quantkit.models.stream import assign_tensor


def calibrated_head(source, paths: HeadPaths, inputs, method, device, store_device="cpu", on_result=None,
                    group=SINGLE) -> dict:
    """{lm_head: its result} from `inputs`, the last block's outputs of every sample (on_result and group as in
    quantkit.calibration.sequential.calibrated_blocks)."""
    head = _load(source, paths).to(device)
    try:
        runner = BlockRunner(head, inputs, ((), {}), device, store_device)
        observers = {"lm_head": method.observer(paths.lm_head, get_weight(head.lm_head))}
        observe_stage(runner, ["lm_head"], observers)
        group.reduce_statistics(list(observers.values()))
        results = dict(stage_results(["lm_head"], lambda n: method.quantize(paths.lm_head, observers.pop(n),
                                                                              head.lm_head), group))
    finally:
        head.to("cpu")
        _release(source, paths)
    return _handed(paths.lm_head, results["lm_head"], on_result)


def data_free_head(source, paths: HeadPaths, method, on_result=None) -> dict:
    """{lm_head: its result} rounded without data (RTN and the other data-free methods)."""
    head = _load(source, paths)
    try:
        res = method.quantize(paths.lm_head, None, head.lm_head)
    finally:
        _release(source, paths)
    return _handed(paths.lm_head, res, on_result)


def _handed(name, res, on_result) -> dict:
    return {name: on_result(name, res) if on_result else res}


def _load(source, paths: HeadPaths) -> Head:
    """The final norm and lm_head with their tensors real, in the compute dtype."""
    source.load(paths.norm)
    source.load_names(source.under(paths.lm_head))  # its own weight (untied) and bias
    if paths.tied:  # the skeleton's lm_head.weight is the embedding's placeholder: lm_head gets a real one
        weight = source.read([paths.embedding], source.dtype)[paths.embedding]
        assign_tensor(source.model, f"{paths.lm_head}.weight", weight)
    return Head(source.model.get_submodule(paths.norm), source.model.get_submodule(paths.lm_head))


def _release(source, paths: HeadPaths) -> None:
    source.release(paths.norm)
    source.release_names(source.under(paths.lm_head))
    if paths.tied:
        weight = source.model.get_submodule(paths.lm_head).weight
        assign_tensor(source.model, f"{paths.lm_head}.weight", torch.empty(weight.shape, dtype=weight.dtype,
                                                                           device="meta"))

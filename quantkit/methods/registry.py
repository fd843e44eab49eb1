"""Adapters between the sequential loop and the per-layer math of each method.

The loop (quantkit.model.sequential) asks a method for: prepare_block (AWQ rescales here), names
(which linears of a stage it quantizes), observer (accumulates calibration statistics: the Hessian
X Xᵀ, used by GPTQ and by the error report of every method) and quantize (-> QuantResult).
"""
from tqdm.auto import tqdm

from quantkit.config import QuantConfig
from quantkit.methods.gptq import GPTQ, output_error
from quantkit.methods.grid import Grid
from quantkit.methods.rtn import rtn
from quantkit.model.arch import Arch


class CalibratedMethod:
    """gptq, awq and awq+gptq: one class, two switches (AWQ scaling first; GPTQ or RTN rounding)."""

    def __init__(self, config: QuantConfig, arch: Arch):
        self.config, self.arch = config, arch
        self.use_awq = config.method in ("awq", "awq+gptq")
        self.use_gptq = config.method in ("gptq", "awq+gptq")
        self.awq_report: dict = {}

    def prepare_block(self, runner, block, prefix):
        if self.use_awq:
            from quantkit.methods.awq import awq_prepare_block

            report = awq_prepare_block(runner, block, prefix, self.arch, self.config)
            self.awq_report.update({f"{prefix}.{k}": v for k, v in report.items()})

    def names(self, prefix, stage):
        return [n for n in stage if self.config.spec_for(f"{prefix}.{n}") is not None]

    def observer(self, full_name, weight):
        return GPTQ(weight)

    def quantize(self, full_name, observer: GPTQ, module):
        spec = self.config.spec_for(full_name)
        grid = Grid(spec.bits, spec.sym)
        bias = getattr(module, "bias", None)
        if self.use_gptq:
            res = observer.quantize(grid, spec.group_size, block_size=self.config.block_size,
                                    damp=self.config.damp, act_order=self.config.act_order, bias=bias)
        else:
            res = rtn(observer.weight, grid, spec.group_size, bias=bias)
        if res.stats.get("message"):  # e.g. damping raised after a failed Cholesky
            tqdm.write(f"{full_name}: {res.stats['message']}")
        res.stats["method"] = self.config.method
        res.stats["error"] = output_error(observer.weight, res.dequantize(), observer.H)
        observer.free()
        return res

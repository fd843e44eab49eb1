"""Method: the one adapter between the model loops and the per-layer math of every method.

The calibration loop (quantkit.calibration.sequential) asks it for: prepare_block (AWQ rescales here),
names (which linears of a stage it quantizes), observer (accumulates the Hessian X Xᵀ used by GPTQ
and by the error report of every method) and quantize (-> QuantResult). RTN needs no data: the API
calls quantize with no observer for each linear. Rotation (config.rotate) is applied here, to the
weight and the Hessian, before whichever rounding the method does; the quantizer comes from the
layer's spec. None of the math below names a grid.
"""
import time

from tqdm.auto import tqdm

from quantkit.algorithms.awq_block import awq_prepare_block
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.hessian import HessianObserver, fidelity
from quantkit.algorithms.registry import method_spec
from quantkit.algorithms.rtn import rtn
from quantkit.models.arch import Arch, get_weight
from quantkit.schemes.rotation import Rotation


class Method:
    """Every method is one class with two switches (AWQ scaling first; GPTQ or RTN rounding: the method's
    MethodSpec), the quantizer and rotation coming from the config: turboquant and e8 are RTN, turboquant+gptq and
    e8+gptq GPTQ, with their codebook behind a Hadamard rotation.

    config: the run's options (quantkit.run.config.QuantConfig); specs: {linear: its LayerSpec, None when left in
    float} (quantkit.run.precheck.layer_specs), or None to read each linear's from the config alone."""

    def __init__(self, config, arch: Arch, specs: dict | None = None):
        self.config, self.arch, self.specs = config, arch, specs
        spec = method_spec(config.method)
        self.use_awq, self.use_gptq = spec.awq, spec.gptq
        self.awq_report: dict = {}

    def spec(self, full_name: str):
        """The LayerSpec of a linear, or None when it stays in floating point."""
        return self.config.spec_for(full_name) if self.specs is None else self.specs.get(full_name)

    @property
    def act_order(self) -> bool:
        """Whether the columns were really quantized out of order (what desc_act should say)."""
        return self.use_gptq and self.config.act_order

    def prepare_block(self, runner, block, prefix):
        if self.use_awq:
            report = awq_prepare_block(runner, block, prefix, self.arch, self.config, self.spec)
            self.awq_report.update({f"{prefix}.{k}": v for k, v in report.items()})

    def names(self, prefix, stage):
        return [n for n in stage if self.spec(f"{prefix}.{n}") is not None]

    def observer(self, full_name, weight):
        """What the calibration loop feeds the layer's inputs: GPTQ's solver for GPTQ rounding, else the Hessian
        alone (every method's error report reads it)."""
        return GPTQ(weight) if self.use_gptq else HessianObserver(weight)

    def quantize(self, full_name, observer, module):
        """QuantResult of one linear; observer None means no calibration data (RTN).

        stats: the method's own (GPTQ: damp, retries, dead, message) plus method, seconds (this call,
        rotation included) and, with data, the calibration tokens it saw and the fidelity of its outputs on them
        (error, cosine, sqnr_db; see hessian.fidelity). A routed expert no calibration token reached is rounded to
        nearest by its quantizer (stats: tokens 0, fallback)."""
        t0 = time.perf_counter()
        fallback = {}
        if observer is not None and observer.nsamples == 0:
            observer.free()
            observer, fallback = None, {"tokens": 0, "fallback": "no calibration token reached it: rounded to nearest"}
        spec = self.spec(full_name)
        quantizer = spec.quantizer()
        bias = getattr(module, "bias", None)
        weight = observer.weight if observer is not None else get_weight(module)
        rotation = None
        if self.config.rotate == "hadamard":
            rotation = Rotation.for_layer(full_name, weight.shape[1], self.config.seed)
            if observer is not None:
                observer.rotate(rotation)
                weight = observer.weight
            else:
                weight = rotation.rotate_weight(weight.float())
        if self.use_gptq and observer is not None:
            res = observer.quantize(quantizer, spec.group_size, block_size=self.config.block_size,
                                    damp=self.config.damp, act_order=self.config.act_order, bias=bias)
        else:
            res = rtn(weight, quantizer, spec.group_size, bias=bias)
        res.rotation = rotation
        if res.stats.get("message"):  # e.g. damping raised after a failed Cholesky
            tqdm.write(f"{full_name}: {res.stats['message']}")
        res.stats.update(method=self.config.method, seconds=time.perf_counter() - t0, **fallback)
        if observer is not None:  # the same in either basis: Π is orthogonal
            res.stats.update(tokens=observer.nsamples, **fidelity(observer.weight, res.decoded(), observer.H))
            if getattr(observer, "routed_tokens", None) is not None:  # a routed expert (quantkit.models.moe)
                res.stats["routed_tokens"] = observer.routed_tokens
            observer.free()
        return res

"""Method: the one adapter between the model loops and the per-layer math of every method.

The calibration loop (quantkit.calibration.sequential) asks it for: prepare_block (the method's preparations run
here: AWQ rescales), names (which linears of a stage it quantizes), observer (accumulates the Hessian X Xᵀ used by
GPTQ and by the error report of every method) and quantize (-> QuantResult). RTN needs no data: the API calls
quantize with no observer for each linear. Rotation (config.rotate) is applied here, to the weight and the Hessian,
before whichever rounding the method does; the quantizer comes from the layer's spec. None of the math below names
an algorithm or a grid: the method's MethodSpec (quantkit.algorithms.registry) names them.
"""
import time

from tqdm.auto import tqdm

from quantkit.algorithms.hessian import fidelity
from quantkit.algorithms.registry import algorithm, method_spec
from quantkit.models.arch import Arch, get_weight
from quantkit.schemes.rotation import Rotation


class Method:
    """A method's registered algorithms driven over one model: its preparations on each block, then its rounding
    of each linear (turboquant and e8 are RTN, turboquant+gptq and e8+gptq GPTQ, with their codebook behind a
    Hadamard rotation, the quantizer and rotation coming from the config).

    config: the run's options (quantkit.run.config.QuantConfig); specs: {linear: its LayerSpec, None when left in
    float} (quantkit.run.precheck.layer_specs), or None to read each linear's from the config alone."""

    def __init__(self, config, arch: Arch, specs: dict | None = None):
        self.config, self.arch, self.specs = config, arch, specs
        method = method_spec(config.method)
        self.preparations = [algorithm(n) for n in method.prepare]
        self.rounding = algorithm(method.rounding)
        self.prepare_report: dict = {}  # {preparation: {group label under its block's prefix: what it found}}

    def check_model(self, model_type: str) -> None:
        """Refuse, before any work, a model family one of the method's algorithms cannot handle."""
        for algo in (*self.preparations, self.rounding):
            algo.check_model(self.arch, model_type)

    def spec(self, full_name: str):
        """The LayerSpec of a linear, or None when it stays in floating point."""
        return self.config.spec_for(full_name) if self.specs is None else self.specs.get(full_name)

    @property
    def act_order(self) -> bool:
        """Whether the columns were really quantized out of order (what desc_act should say)."""
        return self.rounding.act_order(self.config)

    def prepare_block(self, runner, block, prefix):
        for preparation in self.preparations:
            report = preparation.prepare_block(runner, block, prefix, self.arch, self.config, self.spec)
            self.prepare_report.setdefault(preparation.name, {}).update({f"{prefix}.{k}": v for k, v in report.items()})

    def names(self, prefix, stage):
        return [n for n in stage if self.spec(f"{prefix}.{n}") is not None]

    def observer(self, full_name, weight):
        """What the calibration loop feeds the layer's inputs: the rounding's (GPTQ's solver), at least the Hessian
        (every method's error report reads it)."""
        return self.rounding.observer(weight)

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
        res = self.rounding.round(weight, observer, quantizer, spec.group_size, self.config, bias)
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

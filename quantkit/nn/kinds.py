"""The modules a loaded checkpoint's quantized linears become (load_quantized), for code that asks "is this layer
quantized?": QuantLinear (the GPTQ layout), CpuInt4Linear (the same codes repacked for the CPU's int4 GEMM) and
DecodedLinear (every other quantizer)."""
from quantkit.nn.cpu_int4_linear import CpuInt4Linear
from quantkit.nn.decoded_linear import DecodedLinear
from quantkit.nn.quant_linear import QuantLinear

QUANTIZED_LINEARS = (QuantLinear, CpuInt4Linear, DecodedLinear)
INTEGER_GRID_LINEARS = (QuantLinear, CpuInt4Linear)

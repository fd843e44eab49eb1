"""The modules a loaded integer-grid (GPTQ-layout) layer becomes (load_quantized), for code that asks "is this layer
quantized on the integer grid?": QuantLinear, or CpuInt4Linear (the same codes repacked for the CPU's int4 GEMM).
Other quantizers' layers are DecodedLinear."""
from quantkit.nn.cpu_int4_linear import CpuInt4Linear
from quantkit.nn.quant_linear import QuantLinear

INTEGER_GRID_LINEARS = (QuantLinear, CpuInt4Linear)

"""llama.cpp's GGUF: its block types as quantizers, their bytes, its file, its names, and the codec that writes it.

The math of a block type: which codes and scales (quantizers, @register_quantizer of quantkit.schemes.base):
    legacy      Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 (--quantizer ggml)    kquants     Q2_K .. Q6_K (--quantizer kquant)
    iq4         IQ4_NL IQ4_XS (iq4nl, iq4xs)                   iq_lattice  IQ2_XXS IQ3_XXS (iq2xxs, iq3xxs)
                                                               + iq_grids  llama.cpp's point lists, as data
Their bytes: codes and parameters <-> ggml-common.h's blocks, no fitting:
    legacy_blocks (+ the byte helpers the others share) · kquants_blocks · iq4_blocks · iq_lattice_blocks
    types       every block type: its ggml type id, sizes, layout, and the quantizer settings that make it
The file and the codec (quant_method "gguf", @register_codec of quantkit.checkpoint.codecs):
    codec       GGUFCodec: which layers a GGUF file holds, its quantization_config, reading a folder back
    mix         llama.cpp's file types (--gguf-type Q4_K_M, ...): each layer's block type, as llama-quantize picks it
    arch        llama.cpp's names for a transformers model's architecture, hyperparameters and tensors
    file        the GGUF container · vocab: the tokenizer as metadata · export: model.gguf · read: model.gguf back

A layer above quantkit.checkpoint (tests/test_layers.py): the quantizers and the codec register into registries of
lower layers, which never import this package. Importing it registers them all (import_all); quantkit's own
__init__ imports it, so any import of quantkit finds llama.cpp's quantizers and codec in those registries.
"""
from quantkit.core.registry import import_all

import_all(__name__, __path__)

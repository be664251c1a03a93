"""What quantization may do to a family's weights, declared once in each family's weights module
(weights.QUANTIZATION) and asked by the model and the loader (tilekit.models.quantization, models.base). Kept apart
from quantization.py so that a weights module stays light to import (no kernels, no GPU library)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Quantizable:
    """What quantization may do to one family's weights, declared once in its weights module (weights.QUANTIZATION),
    which the model and the loader ask: `linears`, the modules a quantized model holds in 8 bits and runs on
    quant_linear (() for none: the family has no quantized linears); `dequantized`, name patterns of linears it
    keeps in its dtype, dequantized as they load from a quantized checkpoint; `head`, whether an untied LM head may
    be quantized too (head_quantized); `kv_scales`, the suffixes (keys', values') under which a quantized
    checkpoint keeps each layer's static FP8 KV-cache scales (read_kv_scales), or None where the family reads
    none."""

    linears: tuple[str, ...] = ()
    dequantized: tuple[str, ...] = ()
    head: bool = False
    kv_scales: tuple | None = None

"""Bounds and checks the families' quantized-model GPU tests share (tests/models/<family>/test_quantized*.py)."""

import numpy as np

from tilekit.kernels.checks import rel_err

WEIGHT_ONLY_TOL = 2e-2      # bf16 activations on exact dequantized weights: MODEL_TOL["bfloat16"] of test_model
W8A8_TOL = 8e-2             # activations rounded to e4m3 as well (3 mantissa bits, per-token scales)
VS_BF16 = {"int8": 0.05, "fp8": 0.12}     # quantized vs bf16 logits on the same random weights


def logits(model, ids) -> np.ndarray:
    import cupy
    return cupy.asnumpy(model(ids)).astype(np.float64)


def assert_near_bf16(model_class, config, state, kind: str, label: str) -> None:
    """A model quantized to `kind` at load holds logits within VS_BF16 of the bf16 model's on the same weights;
    greedy agreement over 16 tokens printed (-s shows it)."""
    bf16, quant = model_class(config, state=state), model_class(config, state=state, quantize=kind)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (4, 16))
    err = rel_err(logits(quant, ids), logits(bf16, ids))
    a, b = (np.stack(m.generate(ids, 16, temperature=0))[:, 16:] for m in (bf16, quant))
    print(f"{label}{kind}: logits {err:.3g} from bf16's, greedy agreement {np.mean(a == b):.2%}")
    assert err <= VS_BF16[kind]

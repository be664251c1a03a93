"""Every op module's own check (`python -m tilekit.kernels.<op>`) on the GPU."""

import pytest


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("module", ["layer_norm", "gelu", "linear", "attention", "decode_attention", "write_kv",
                                    "embedding", "next_token", "rms_norm", "apply_rope", "swiglu_linear",
                                    "residual_linear", "quant_linear", "quantize_fp8", "fixed_cast", "head_linear",
                                    "mla_kv"])
def test_each_op_module_checks_itself(module):
    """`python -m tilekit.kernels.<op>`: the op's own check against its reference (write_kv's is the
    KV-cache write test, clipping included)."""
    import runpy
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # runpy: the module is also imported
        runpy.run_module(f"tilekit.kernels.{module}", run_name="__main__")

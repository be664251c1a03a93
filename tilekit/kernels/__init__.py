"""cuTile kernels, one module per op; importing them declares every op (tilekit.autotune.op.Op)."""

from tilekit.kernels.attention import attention
from tilekit.kernels.decode_attention import decode_attention
from tilekit.kernels.embedding import embedding
from tilekit.kernels.gelu import gelu
from tilekit.kernels.kv_cache import write_kv
from tilekit.kernels.layernorm import layer_norm
from tilekit.kernels.linear import linear
from tilekit.kernels.next_token import next_token
from tilekit.kernels.residual_linear import residual_linear
from tilekit.kernels.rmsnorm import rms_norm
from tilekit.kernels.rope import apply_rope
from tilekit.kernels.sampling import greedy_step
from tilekit.kernels.swiglu import swiglu_linear

__all__ = ["apply_rope", "attention", "decode_attention", "embedding", "gelu", "greedy_step", "layer_norm", "linear",
           "next_token", "residual_linear", "rms_norm", "swiglu_linear", "write_kv"]

"""cuTile kernels, one module per op; importing them declares every op (tilekit.autotune.op.Op)."""

from tilekit.kernels.apply_rope import apply_rope
from tilekit.kernels.attention import attention
from tilekit.kernels.decode_attention import decode_attention
from tilekit.kernels.embedding import embedding
from tilekit.kernels.fixed_cast import fixed_cast
from tilekit.kernels.gelu import gelu
from tilekit.kernels.head_linear import head_linear
from tilekit.kernels.layer_norm import layer_norm
from tilekit.kernels.linear import linear
from tilekit.kernels.mla_decode_attention import mla_decode_attention
from tilekit.kernels.mla_kv import mla_kv
from tilekit.kernels.moe_down_combine import moe_down_combine
from tilekit.kernels.moe_gate_up import moe_gate_up
from tilekit.kernels.moe_permute import moe_permute
from tilekit.kernels.moe_router import moe_router
from tilekit.kernels.next_token import next_token
from tilekit.kernels.paged_decode_attention import paged_decode_attention
from tilekit.kernels.paged_mla_decode_attention import paged_mla_decode_attention
from tilekit.kernels.paged_prefill_attention import paged_prefill_attention
from tilekit.kernels.paged_write_kv import paged_write_kv
from tilekit.kernels.quant_linear import quant_linear
from tilekit.kernels.quantize_fp8 import quantize_fp8
from tilekit.kernels.residual_linear import residual_linear
from tilekit.kernels.rms_norm import rms_norm
from tilekit.kernels.swiglu_linear import swiglu_linear
from tilekit.kernels.token_bitmask import token_bitmask
from tilekit.kernels.write_kv import write_kv

__all__ = ["apply_rope", "attention", "decode_attention", "embedding", "fixed_cast", "gelu", "head_linear", "layer_norm",
           "linear", "mla_decode_attention", "mla_kv", "moe_down_combine", "moe_gate_up", "moe_permute", "moe_router",
           "next_token", "paged_decode_attention", "paged_mla_decode_attention", "paged_prefill_attention",
           "paged_write_kv", "quant_linear", "quantize_fp8", "residual_linear", "rms_norm", "swiglu_linear",
           "token_bitmask", "write_kv"]

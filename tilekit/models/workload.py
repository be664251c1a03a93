"""The kernel problems a GPT-2 model runs: what `tilekit tune --model` tunes and `db explain` reports.

Mirrors GPT's prefill (full logits, or last-token logits when generating) and its decode step, so
that every key tuned here is a key the model asks for.
"""

from __future__ import annotations

from tilekit.autotune.op import TunableOp
from tilekit.kernels.attention import ATTENTION
from tilekit.kernels.decode_attention import DECODE_ATTENTION
from tilekit.kernels.embedding import EMBEDDING
from tilekit.kernels.kv_cache import KV_WRITE
from tilekit.kernels.layernorm import LAYER_NORM
from tilekit.kernels.linear import LINEAR
from tilekit.kernels.sampling import GREEDY
from tilekit.models.config import GPTConfig


def _linears(dtype: str, M: int, C: int, V: int, logits_rows: int | None) -> list[tuple[TunableOp, dict]]:
    base = dict(dtype=dtype, M=M, wt="kn", bias=1, act="none", res=0, tf32=0)
    out = [(LINEAR, dict(base, N=3 * C, K=C)),                        # attn.c_attn
           (LINEAR, dict(base, N=C, K=C, res=1)),                     # attn.c_proj + residual
           (LINEAR, dict(base, N=4 * C, K=C, act="gelu")),            # mlp.c_fc + GELU
           (LINEAR, dict(base, N=C, K=4 * C, res=1))]                 # mlp.c_proj + residual
    if logits_rows is not None:                                       # tied LM head
        out.append((LINEAR, dict(base, M=logits_rows, N=V, K=C, wt="nk", bias=0)))
    return out


def model_problems(config: GPTConfig, dtype: str = "bfloat16", batch_sizes=(1, 8), seq_lens=(128, 1024),
                   *, prefill: bool = True, decode: bool = True, full_logits: bool = True) -> list[tuple[TunableOp, dict]]:
    """Distinct (op, problem) pairs of prefill at B x T and of decoding with a T-position cache."""
    C, H, D, V, P = config.n_embd, config.n_head, config.head_dim, config.vocab_size, config.block_size
    found: dict[tuple, tuple[TunableOp, dict]] = {}

    def add(op, problem):
        found.setdefault((op.name, op.problem_key(problem)[1]), (op, problem))

    for B in batch_sizes:
        for T in seq_lens:
            T = min(T, P)
            capacity = min(P, -(-T // 64) * 64)
            if prefill:
                M = B * T
                add(EMBEDDING, dict(dtype=dtype, ids="int32", M=M, C=C, V=V, P=P))
                add(LAYER_NORM, dict(dtype=dtype, M=M, N=C, gather=0))
                for pair in _linears(dtype, M, C, V, M if full_logits else None):
                    add(*pair)
                add(ATTENTION, dict(dtype=dtype, B=B, H=H, Tq=T, Tk=T, D=D, causal=1))
                add(KV_WRITE, dict(dtype=dtype, B=B, H=H, T=T, capacity=capacity, D=D))
                add(LAYER_NORM, dict(dtype=dtype, M=B, N=C, gather=1))      # last-token rows
                add(LINEAR, _linears(dtype, B, C, V, B)[-1][1])
            if decode:
                add(EMBEDDING, dict(dtype=dtype, ids="int32", M=B, C=C, V=V, P=P))
                add(LAYER_NORM, dict(dtype=dtype, M=B, N=C, gather=0))
                for pair in _linears(dtype, B, C, V, B):
                    add(*pair)
                add(KV_WRITE, dict(dtype=dtype, B=B, H=H, T=1, capacity=capacity, D=D))
                add(DECODE_ATTENTION, dict(dtype=dtype, B=B, H=H, nq=1, capacity=capacity, D=D))
                add(GREEDY, dict(dtype=dtype, B=B, V=V, L=capacity + 1))
    return list(found.values())

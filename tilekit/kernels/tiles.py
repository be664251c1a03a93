"""The tile helpers (@ct.function) and constants that several ops' kernels share: the dependent-launch
sync, the fixed-point residual stream, the (batch, head) split, the online-softmax step, the grouped tile
order, the tanh GELU and the fp32 product on tensor cores.

Programmatic dependent launch: every tilekit kernel may start while the kernel before it finishes.

tilekit's launch path launches each kernel with programmatic_dependent_launch=True, so on Hopper
its programs can be scheduled, and prefetch what no earlier kernel writes (weights), while the
kernel before it on the stream is still running. Every kernel therefore calls
`sync_with_previous_kernel()` before it reads anything an earlier kernel may have written, and
before it writes anything at all (the peer all-reduce waits there too, but lets its dependents
launch only once its peers are in: its module doc). Launched without the flag (the tuner, a plain ct.launch), the
call costs nothing.

The fixed-point residual stream: int64 arrays holding value * 2**32.

With few rows (a decode step), a projection whose output is added to the residual is split over
many programs, each owning a slice of the reduction, and every program adds its partial sum into
the residual in place with an atomic add. Integer additions commute exactly, so the result is the
same bit for bit whatever order the programs finish in (float atomics would not be), and 32
fraction bits resolve 2.3e-10 on a range of +-2**31, far finer than the fp32 the partial sums are
computed in. Kernels read the stream through `from_fixed` and write it through `to_fixed`.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

SQRT_2_OVER_PI = 0.7978845608028654
FIXED_DTYPE = "int64"
ONE = 4294967296.0           # 2**32: the fixed-point value of 1.0


@ct.function
def to_fixed(t):
    """An fp32 tile as fixed point (int64, truncated to a multiple of 2**-32)."""
    return (t * ONE).astype(ct.int64)


@ct.function
def from_fixed(t):
    """A fixed-point tile as fp32."""
    return t.astype(ct.float32) * (1.0 / ONE)


@ct.function
def add_fixed(Acc, rows, cols, t):
    """Acc[rows, cols] += t (fp32 tile) atomically; indices outside Acc are skipped. Relaxed order:
    nothing reads Acc before the kernel ends."""
    ct.atomic_add(Acc, (rows, cols), to_fixed(t), memory_order=ct.MemoryOrder.RELAXED)


def fixed_to_float(a) -> np.ndarray:
    """A host copy of a fixed-point array as float64 (exact below 2**21)."""
    return np.asarray(a, np.int64).astype(np.float64) / ONE


def float_to_fixed(a) -> np.ndarray:
    """float values as an int64 fixed-point host array (rounded to the nearest 2**-32)."""
    return np.rint(np.asarray(a, np.float64) * ONE).astype(np.int64)


@ct.function
def sync_with_previous_kernel():
    """Let the next kernel on the stream be scheduled now, then wait until the previous kernel has
    finished and its writes are visible."""
    ct.grid_dependency_control_launch_dependents()
    ct.grid_dependency_control_wait()


@ct.function
def batch_head(bh, H):
    """(batch, head) of a program's flat batch x heads index."""
    return bh // H, bh % H


@ct.function
def online_softmax_step_by_column(s, m_i, l_i, acc, v_t):
    """Fold one tile of log2-scaled scores s[BN, QP] (a column per query) and values v_t[D, BN] into (m, l, acc):
    m_i and l_i [1, QP], acc[D, QP]. A few queries against many keys put the keys on the products' M axis, the one
    the Hopper tensor cores' asynchronous MMA tiles by 64, with its operands in shared memory instead of registers."""
    m_new = ct.maximum(m_i, ct.max(s, axis=0, keepdims=True))
    m_safe = ct.where(m_new == -math.inf, 0.0, m_new)
    p = ct.exp2(s - m_safe)
    alpha = ct.exp2(m_i - m_safe)
    l_i = l_i * alpha + ct.sum(p, axis=0, keepdims=True)
    acc = ct.mma(v_t, p.astype(v_t.dtype), acc * alpha)
    return m_new, l_i, acc


@ct.function
def online_softmax_fold_key(s_t, m_i, l_i, acc, v_col):
    """online_softmax_step_by_column for one key as a rank-1 update: its log2-scaled scores s_t[1, QP] and its
    fp32 value v_col[D, 1] (as an MMA tile, a few new tokens' keys spilled registers)."""
    m_new = ct.maximum(m_i, s_t)
    m_safe = ct.where(m_new == -math.inf, 0.0, m_new)
    p_t = ct.exp2(s_t - m_safe)
    alpha = ct.exp2(m_i - m_safe)
    return m_new, l_i * alpha + p_t, acc * alpha + v_col * p_t


def lends_split_k(config) -> bool:
    """Whether a tuned config of a split-K op (linear, quant_linear, moe_router) may serve the problems it was not
    tuned for (Op borrowable): not split-K with two programs a SM. Such configs summed wrongly now and then on
    shapes they were not checked on (the tuner rejects 4-11 of them per few-row quant_linear shape against the
    default config; a borrowed or default one broke a tensor-parallel FP8 forward; cause not found)."""
    return config.get("SPLIT_K", 1) == 1 or config.get("occupancy", 1) == 1


@ct.function
def grouped_tile(tile, tiles_m, tiles_n, GROUP_M):
    """(row tile, column tile) of a program in grouped order: GROUP_M row tiles share each column
    panel of the weights while it sits in L2."""
    group_width = GROUP_M * tiles_n
    first_m = (tile // group_width) * GROUP_M
    group_rows = ct.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % group_width) % group_rows, (tile % group_width) // group_rows


@ct.function
def gelu_tanh(x):
    """0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), on an fp32 tile.

    Written as x / (1 + exp(-2u)), the same function, so that the negative tail keeps its relative
    accuracy instead of cancelling in 1 + tanh(u). The division is the approximate one (2 ulp): the
    IEEE one leaves its fast path when exp(-2u) overflows (u < -44, x < -10), and an epilogue with many
    such values, as the tuner's unscaled random GEMMs make, ran at half speed.
    """
    u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    return ct.truediv(x, 1.0 + ct.exp(-2.0 * u), flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX)


TF32_HIGH_BITS = -8192       # 0xFFFFE000: sign, exponent and the 10 mantissa bits a tf32 operand keeps


@ct.function
def tensor_mma(a, b, acc):
    """acc + a @ b on tensor cores, fp32 tiles included (to about fp32 accuracy, 3xTF32). fp32 ct.mma runs on FMA
    units with its tiles in registers, at about 2 TFLOP/s in GPT-2's prefill (docs/results/fp32-tiles-sm90.txt);
    here each fp32 operand is split into a high part (its top 10 mantissa bits, exact in tf32) and the rest
    rounded to tf32, and a_hi b_hi + a_hi b_lo + a_lo b_hi leaves out only a_lo b_lo and that rounding: each
    product is off by about 2^-21 of its size, against 2^-24 for an fp32 FMA and 2^-11 for one tf32 product.
    The products of one call start from zero and join acc in an fp32 add: chained through acc, the tensor cores'
    additions (which round toward zero) drifted by 1e-5 over 6400 terms (H100)."""
    if a.dtype == ct.float32:
        a_hi = ct.bitcast(ct.bitcast(a, ct.int32) & TF32_HIGH_BITS, ct.float32)
        b_hi = ct.bitcast(ct.bitcast(b, ct.int32) & TF32_HIGH_BITS, ct.float32)
        a_lo = (a - a_hi).astype(ct.tfloat32)
        b_lo = (b - b_hi).astype(ct.tfloat32)
        a_hi = a_hi.astype(ct.tfloat32)
        b_hi = b_hi.astype(ct.tfloat32)
        zeros = ct.zeros(acc.shape, dtype=ct.float32)
        small = ct.mma(a_hi, b_lo, ct.mma(a_lo, b_hi, zeros))
        return acc + (ct.mma(a_hi, b_hi, zeros) + small)
    return ct.mma(a, b, acc)

"""The per-head keys and values of multi-head latent attention (DeepSeek-V2's MLA) over whole prompts.

kv_b_proj expands each token's latent into kv (M, H, dn + dv): per head the non-rotary key, then the value. This op
writes what tilekit's attention reads: keys k (M, H, dn + P) = [kv[..., :dn], the token's one rotary key k_pe],
the same k_pe for every head, and values v[..., :dv] = kv[..., dn:] into a buffer whose columns past dv stay as
they are (zeros: attention takes one head dim for q, k and v, so the values are zero-padded to q's; the output's
padded columns are then zero and ignored). (Better: attention with a value head dim of its own, and with the
rotary part as a second, shared key: no padding, no copies; a change to the attention kernel.)
"""

from __future__ import annotations

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import sync_with_previous_kernel


@ct.kernel
def mla_kv_kernel(KV, PE, K, V, DN: ct.Constant[int], TM: ct.Constant[int], TD: ct.Constant[int],
                  TP: ct.Constant[int]):
    """K[m, h] = [KV[m, h, :DN], PE[m]], V[m, h, :dv] = KV[m, h, DN:] for rows TM*bid(0).. of head bid(1)."""
    sync_with_previous_kernel()
    h = ct.bid(1)
    rows = (ct.bid(0) * TM + ct.arange(TM, dtype=ct.int32)).reshape((TM, 1))
    cols = ct.arange(TD, dtype=ct.int32).reshape((1, TD))
    nope = cols < DN
    ct.scatter(K, (rows, h, cols), ct.gather(KV, (rows, h, cols), mask=nope), mask=nope)
    value = cols < KV.shape[2] - DN
    ct.scatter(V, (rows, h, cols), ct.gather(KV, (rows, h, cols + DN), mask=value), mask=value)
    rotary = ct.arange(TP, dtype=ct.int32).reshape((1, TP))
    ct.scatter(K, (rows, h, rotary + DN), ct.gather(PE, (rows, rotary)))


def _fits(c: dict, p: dict) -> bool:
    return c["TM"] <= max(1, pow2_ceil(p["M"]))


SPACE = SearchSpace(_fits, TM=(1, 2, 4, 8, 16, 32), occupancy=(2, 4))


def default_config(p: dict) -> dict:
    return dict(TM=min(8, pow2_ceil(p["M"])), occupancy=4)


def _arrays(p: dict) -> dict:
    M, H, DN, DV, P, dt = p["M"], p["H"], p["DN"], p["DV"], p["P"], p["dtype"]
    return {"kv": ArraySpec(dt, (M, H, DN + DV)), "pe": ArraySpec(dt, (M, P)),
            "k": ArraySpec(dt, (M, H, DN + P), role="out"), "v": ArraySpec(dt, (M, H, max(DV, DN + P)), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), p["H"], 1)


def _constants(p: dict, c: dict) -> tuple:
    return (p["DN"], c["TM"], pow2_ceil(max(p["DN"], p["DV"])), pow2_ceil(p["P"]))


def _bind(a: list, flags: tuple) -> Binding:
    kv, k_pe, k, v = a
    (dn,) = flags
    arrays.check_dtype(kv, "kv", arrays.FLOAT_DTYPES)
    if len(kv.shape) != 3 or 0 in kv.shape:
        raise ValueError(f"kv must be a non-empty 3-D (rows, heads, dn + dv) array, got shape {kv.shape}")
    M, H, width = kv.shape
    if not isinstance(dn, int) or not 0 < dn < width:
        raise ValueError(f"dn must be an int in 1..{width - 1} (kv's width {width} holds dn keys, then values), "
                         f"got {dn!r}")
    if len(k_pe.shape) != 2 or k_pe.shape[0] != M:
        raise ValueError(f"k_pe must be ({M}, rotary width), got shape {k_pe.shape}")
    P = k_pe.shape[1]
    for name, x in (("k_pe", k_pe), ("k", k), ("v", v)):
        arrays.check_same("kv", kv, name, x)
        arrays.check_last_contiguous(x, name)
    arrays.check_last_contiguous(kv, "kv")
    arrays.check_out(k, "k", kv, (M, H, dn + P), contiguous=False)
    if len(v.shape) != 3 or v.shape[:2] != (M, H) or v.shape[2] < width - dn:
        raise ValueError(f"v must be ({M}, {H}, >= {width - dn}), got shape {v.shape}")
    return Binding(problem=dict(dtype=kv.dtype, M=M, H=H, DN=dn, DV=width - dn, P=P),
                   arrays={"kv": (0, None), "pe": (1, None), "k": (2, None), "v": (3, None)})


MLA_KV = Op(
    "mla_kv", args=("kv", "k_pe", "k", "v"), key=dict(dtype=None, M=pow2_bucket, H=None, DN=None, DV=None, P=None),
    space=SPACE, default=default_config, arrays=_arrays,
    launches=(Launch(mla_kv_kernel, _grid, ("kv", "pe", "k", "v"), _constants),), bind=_bind)


def mla_kv(kv, k_pe, k, v, *, dn: int) -> None:
    """k[m, h] = [kv[m, h, :dn], k_pe[m]] and v[m, h, :dv] = kv[m, h, dn:] (dv = kv's width - dn; v's columns past
    dv are left as they are). kv (M, H, dn + dv), k_pe (M, P), k (M, H, dn + P), v (M, H, >= dv): any strides with a
    contiguous last dimension."""
    MLA_KV((kv, k_pe, k, v), (dn,))


def mla_kv_reference(kv, k_pe, dn: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 (k, v[..., :dv])."""
    kv, k_pe = np.asarray(kv, np.float64), np.asarray(k_pe, np.float64)
    M, H, _ = kv.shape
    return np.concatenate([kv[..., :dn], np.broadcast_to(k_pe[:, None], (M, H, k_pe.shape[1]))], -1), kv[..., dn:]


if __name__ == "__main__":
    from tilekit.kernels.mla_kv import mla_kv, mla_kv_reference  # the package's op, not this script's copy

    from tilekit.kernels.checks import host, poisoned, rand
    for M, H, dn, dv, P, dtype in [(300, 16, 128, 128, 64, "bfloat16"), (5, 3, 16, 8, 16, "float32")]:
        kv, pe = rand((M, H, dn + dv), dtype), rand((M, 576), dtype)[:, 512:512 + P]
        k, v = poisoned((M, H, dn + P), dtype), poisoned((M, H, dn + P), dtype)
        before = host(v)
        mla_kv(kv, pe, k, v, dn=dn)
        ref_k, ref_v = mla_kv_reference(host(kv), host(pe), dn)
        assert np.array_equal(host(k), ref_k) and np.array_equal(host(v)[..., :dv], ref_v), "mla_kv differs"
        assert np.array_equal(host(v)[..., dv:], before[..., dv:], equal_nan=True), "mla_kv wrote v's padding"
    print("mla_kv: ok, exact")

"""Structured output's mask on the logits: each row's allowed tokens as a bitmask (32 tokens a word, bit v % 32 of
word v // 32, the layout grammar engines fill), every disallowed token's logit set to -inf in place, before
penalties and the pick. A row whose words are all ones (-1) is left as it is, so that one launch covers a batch
where only some requests are constrained."""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def token_bitmask_kernel(Logits, Mask, BV: ct.Constant[int]):
    """Program (r, j): columns j*BV .. j*BV+BV-1 of row r, -inf where their bit in Mask[r] is clear."""
    sync_with_previous_kernel()
    r = ct.bid(0)
    j = ct.bid(1)
    cols = ct.arange(BV, dtype=ct.int32) + j * BV
    words = ct.gather(Mask, (r, cols // 32), padding_value=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    x = ct.load(Logits, (r, j), (1, BV), padding_mode=ZERO).reshape((BV,)).astype(ct.float32)
    y = ct.where(allowed, x, -math.inf)
    ct.store(Logits, (r, j), y.reshape((1, BV)).astype(Logits.dtype))


def words(vocab: int) -> int:
    """Mask words a row of `vocab` tokens takes."""
    return -(-vocab // 32)


def _fits(c: dict, p: dict) -> bool:
    return c["BV"] <= max(256, pow2_ceil(p["V"]))


SPACE = SearchSpace(_fits, BV=(256, 512, 1024, 2048, 4096), occupancy=(1, 2, 4))


def default_config(p: dict) -> dict:
    return dict(BV=min(1024, max(256, pow2_ceil(p["V"]))), occupancy=2)


def _arrays(p: dict) -> dict:
    return {"logits": ArraySpec(p["dtype"], (p["R"], p["V"]), role="out"),
            "mask": ArraySpec("int32", (p["R"], words(p["V"])))}


def _grid(p: dict, c: dict) -> tuple:
    return (p["R"], ct.cdiv(p["V"], c["BV"]), 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["BV"],)


def _bind(a: list, flags: tuple) -> Binding:
    logits, mask = a
    arrays.check_dtype(logits, "logits", arrays.FLOAT_DTYPES)
    arrays.check_dtype(mask, "mask", ("int32",))
    if len(logits.shape) != 2 or 0 in logits.shape:
        raise ValueError(f"logits must be a non-empty (rows, vocab) array, got shape {logits.shape}")
    R, V = logits.shape
    if mask.shape != (R, words(V)):
        raise ValueError(f"mask must have shape {(R, words(V))} (32 tokens a word) for logits of shape {(R, V)}, "
                         f"got {mask.shape}")
    arrays.check_contiguous(logits, "logits")
    arrays.check_contiguous(mask, "mask")
    return Binding(problem=dict(dtype=logits.dtype, R=R, V=V), arrays={"logits": (0, None), "mask": (1, None)},
                   returns=0)


TOKEN_BITMASK = Op("token_bitmask", args=("logits", "mask"), key=dict(dtype=None, R=pow2_bucket, V=None),
                   space=SPACE, default=default_config, arrays=_arrays,
                   launches=(Launch(token_bitmask_kernel, _grid, ("logits", "mask"), _constants),), bind=_bind)


def token_bitmask(logits, mask):
    """logits (rows, vocab) in place: -inf wherever bit v % 32 of mask[row, v // 32] (int32) is clear."""
    return TOKEN_BITMASK((logits, mask))


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """(rows, vocab) booleans of a bitmask's allowed tokens (NumPy)."""
    bits = (np.asarray(mask, np.int64)[:, :, None] >> np.arange(32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab].astype(bool)


def token_bitmask_reference(logits, mask) -> np.ndarray:
    """float64 logits with every disallowed token at -inf."""
    out = np.array(logits, np.float64)
    out[~allowed_tokens(mask, out.shape[1])] = -np.inf
    return out

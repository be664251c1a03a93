"""mla_decode_attention against its float64 reference on the GPU: fresh random queries and latent caches (views of
one (B, capacity, R + P) buffer, as the model keeps it), poisoned outputs, one split and many, the new entries
written into the cache, every head group size."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand  # noqa: E402
from tilekit.kernels.mla_decode_attention import (MLA_DECODE_ATTENTION, mla_decode_attention,  # noqa: E402
                                                  mla_decode_attention_reference)


def check_mla(B, H, nq, cap, R, P, dtype, new=True, scale=0.1147, offset=0, rng=np.random.default_rng(0)):
    queries, cache = rand((B, nq, H, R + P), dtype), rand((B, cap, R + P), dtype)
    q, q_pe = queries[..., :R].transpose(0, 2, 1, 3), queries[..., R:].transpose(0, 2, 1, 3)
    c, pe = cache[..., :R], cache[..., R:]
    entries = rand((B, nq, R + P), dtype) if new else None
    kw = dict(new_c=entries[..., :R], new_pe=entries[..., R:]) if new else {}
    lengths = rng.integers(nq, cap + 1, B).astype(np.int32) - offset
    lengths[0] = cap - offset                                 # one sequence that fills the cache
    ref = mla_decode_attention_reference(host(q), host(q_pe), host(c), host(pe), lengths, scale=scale,
                                         length_offset=offset, **{k: host(v) for k, v in kw.items()})
    before = host(cache)
    out = poisoned((B, nq, H, R), dtype).transpose(0, 2, 1, 3)
    assert mla_decode_attention(q, q_pe, c, pe, cupy.asarray(lengths), scale=scale, length_offset=offset, out=out,
                                **kw) is out
    assert_close(host(out), ref, TOL[dtype], f"mla_decode_attention {(B, H, nq, cap, R, P, dtype, new)}")
    after = host(cache)
    for b, n in enumerate(lengths + offset):
        if new:
            np.testing.assert_array_equal(after[b, n - nq:n], host(entries)[b], "new entries not in the cache")
            after[b, n - nq:n] = before[b, n - nq:n]
    np.testing.assert_array_equal(after, before, "the cache changed outside the new entries")


@pytest.mark.parametrize("B, H, nq, cap, R, P, dtype", [
    (1, 16, 1, 128, 512, 64, "bfloat16"), (1, 16, 1, 4096, 512, 64, "bfloat16"), (8, 16, 1, 1000, 512, 64, "bfloat16"),
    (2, 128, 1, 300, 512, 64, "bfloat16"), (3, 16, 4, 700, 512, 64, "float16"), (2, 4, 3, 100, 32, 16, "float32"),
    (2, 5, 2, 77, 48, 16, "bfloat16")])
@pytest.mark.parametrize("new", [True, False])
def test_mla_decode_matches_reference(B, H, nq, cap, R, P, dtype, new):
    check_mla(B, H, nq, cap, R, P, dtype, new)


def test_length_offset_counts_the_new_token():
    check_mla(2, 16, 1, 256, 512, 64, "bfloat16", offset=1)


# groups of hp heads: one of all heads (padded to 16 query rows), and many (tiles of the heads axis), with nq tokens
# padded to a power of two (nq = 3)
@pytest.mark.parametrize("H, nq, hp", [(16, 1, 16), (16, 4, 4), (16, 3, 8), (128, 1, 32), (4, 1, 4)])
@pytest.mark.parametrize("chunk", [64, 2048])
def test_every_head_group_and_split(H, nq, hp, chunk):
    with MLA_DECODE_ATTENTION.pinned(dict(HP=hp, BN=64, CHUNK=chunk, occupancy=1)):
        check_mla(2, H, nq, 1500, 512, 64, "bfloat16")

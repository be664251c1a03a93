"""token_bitmask: its NumPy reference against llguidance's own NumPy masking (CPU), its argument checks (CPU, on
MetaArrays), and the kernel on the GPU against the reference, row by row."""

import numpy as np
import pytest

from tilekit.autotune.arrays import MetaArray
from tilekit.kernels.token_bitmask import allowed_tokens, token_bitmask, token_bitmask_reference, words


def random_mask(rng, rows: int, vocab: int, density: float) -> np.ndarray:
    allowed = rng.random((rows, words(vocab) * 32)) < density
    allowed[0] = True                                    # an unconstrained row: every word -1
    bits = allowed.reshape(rows, -1, 32).astype(np.int64) << np.arange(32)
    return bits.sum(axis=2).astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 1031, 50257])
def test_the_reference_masks_as_llguidance_does(vocab):
    llg = pytest.importorskip("llguidance.numpy")
    rng = np.random.default_rng(vocab)
    mask = random_mask(rng, 4, vocab, 0.3)
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    theirs = logits.copy()
    llg.apply_token_bitmask_inplace(theirs, mask)
    np.testing.assert_array_equal(token_bitmask_reference(logits, mask), theirs.astype(np.float64))
    assert (mask[0] == -1).all() and allowed_tokens(mask, vocab)[0].all()


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"mask must have shape \(3, 4\)"):
        token_bitmask(MetaArray((3, 100), "float32"), MetaArray((3, 3), "int32"))
    with pytest.raises(TypeError, match="mask has dtype int64; supported: int32"):
        token_bitmask(MetaArray((3, 100), "float32"), MetaArray((3, 4), "int64"))
    with pytest.raises(ValueError, match="logits must be a non-empty"):
        token_bitmask(MetaArray((300,), "float32"), MetaArray((10,), "int32"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab,dtype,density", [(1, 128256, "bfloat16", 0.01), (5, 1031, "float32", 0.5),
                                                      (64, 50257, "bfloat16", 0.9), (3, 259, "float16", 0.2),
                                                      (33, 32000, "float32", 0.0)])
def test_the_kernel_matches_the_reference_row_by_row(rows, vocab, dtype, density):
    import cupy

    from tilekit.kernels.checks import host, rand
    rng = np.random.default_rng()
    logits = rand((rows, vocab), dtype, 4.0)
    before = host(logits).astype(np.float64)
    mask = random_mask(rng, rows, vocab, density)
    token_bitmask(logits, cupy.asarray(mask))
    ref = token_bitmask_reference(before, mask)
    out = host(logits).astype(np.float64)
    for r in range(rows):                   # a logit is kept bit for bit or becomes -inf, nothing else
        np.testing.assert_array_equal(out[r], ref[r], err_msg=f"row {r}")

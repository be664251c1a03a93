"""Outputs with padded rows (a [..., :N] slice of a wider buffer) on CPU: which layouts linear accepts,
forward()'s logits layout, and which linear launches use programmatic dependent launch."""

import pytest

import tilekit.kernels  # noqa: F401  (declares the ops)
from tilekit.engine.steps import logits
from tilekit.autotune.arrays import MetaArray, check_rows, info
from tilekit.kernels.linear import LINEAR
from tilekit.models import GPT
from tilekit.models.gpt2.config import GPTConfig
from tilekit.engine.steps import LOGIT_ROW_ALIGN
from tilekit.models.base import META


def meta_linear(out):
    x, w = MetaArray(out.shape[:-1] + (32,), "bfloat16"), MetaArray((32, out.shape[-1]), "bfloat16")
    return LINEAR((x, w, None, None, out), (None, "in_out", False))


@pytest.mark.parametrize("out", [MetaArray((6, 50), "bfloat16"), MetaArray((6, 64), "bfloat16")[:, :50],
                                 MetaArray((2, 3, 64), "bfloat16")[:, :, :50],
                                 MetaArray((1, 6, 64), "bfloat16")[0, :, :50]])
def test_contiguous_and_padded_rows_are_accepted(out):
    check_rows(info(out, "out"), "out")
    assert meta_linear(out) is out


@pytest.mark.parametrize("out", [MetaArray((6, 50), "bfloat16", strides=(10, 1)),      # rows overlap
                                 MetaArray((50, 6), "bfloat16").transpose(1, 0),         # columns contiguous
                                 MetaArray((3, 2, 64), "bfloat16").transpose(1, 0, 2)[:, :, :50]])  # no 2-D view
def test_rows_that_do_not_view_as_one_matrix_are_refused(out):
    with pytest.raises(ValueError, match="out must"):
        meta_linear(out)


def test_forward_logits_rows_are_padded():
    model = GPT(GPTConfig.preset("gpt2"), meta=True)
    out = logits(model, MetaArray((6, 768), "bfloat16"), META)
    padded = -(-50257 // LOGIT_ROW_ALIGN) * LOGIT_ROW_ALIGN
    assert out.shape == (6, 50257) and out.strides == (padded, 1) and padded % 64 == 0


def test_persistent_linear_grids_launch_ordinarily():
    problem = dict(dtype="bfloat16", M=8192, N=2304, K=768, wt="kn", bias=1, act="none", res=0, tf32=0)
    config = LINEAR.default(problem)
    (launch,) = LINEAR.launches
    assert launch.dependent(problem, dict(config, PERSISTENT=1)) is False
    assert launch.dependent(problem, dict(config, PERSISTENT=0)) is True

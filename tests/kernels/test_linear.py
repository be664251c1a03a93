"""linear on the GPU against its float64 reference: layouts, bias, GELU and residual epilogues, padded output
rows, split-K and persistent grids."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tilekit.autotune import store
from tilekit.device import device_info
from tilekit.kernels import linear
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
from tilekit.kernels.linear import LINEAR, linear_reference

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=12, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


def check_linear(M, N, K, dtype, layout="in_out", bias=True, act=None, res=False, tf32=False):
    x = rand((M, K), dtype)
    w = rand((K, N) if layout == "in_out" else (N, K), dtype, 1 / math.sqrt(K))
    b = rand((N,), dtype) if bias else None
    r = rand((M, N), dtype) if res else None
    out = poisoned((M, N), dtype)
    y = linear(x, w, b, activation=act, residual=r, out=out, weight_layout=layout, allow_tf32=tf32)
    assert y is out
    ref = linear_reference(host(x), host(w), None if b is None else host(b), activation=act,
                           residual=None if r is None else host(r), weight_layout=layout)
    tol = TOL["tf32"] if tf32 else TOL[dtype]
    assert_close(host(y), ref, tol, f"linear {(M, N, K, dtype, layout, bias, act, res)}")


@GPU
@given(M=st.sampled_from([1, 3, 8, 64, 127, 1000]), N=st.sampled_from([64, 200, 768, 1031]),
       K=st.sampled_from([64, 72, 768]), dtype=DTYPES, layout=st.sampled_from(["in_out", "out_in"]),
       bias=st.booleans(), act=st.sampled_from([None, "gelu"]), res=st.booleans())
def test_linear_matches_reference(M, N, K, dtype, layout, bias, act, res):
    check_linear(M, N, K, dtype, layout, bias, act, res)


@pytest.mark.parametrize("M", [1, 8191])
def test_linear_edge_rows(M):
    check_linear(M, 768, 768, "bfloat16", act="gelu", res=True)


def test_linear_tf32():
    check_linear(300, 256, 512, "float32", tf32=True)


def test_linear_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 5, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16) / 8
    y = linear(x, w)
    assert isinstance(y, torch.Tensor) and y.shape == (2, 5, 96) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double()
    assert_close(y.double().cpu().numpy(), ref.cpu().numpy(), TOL["bfloat16"], "torch linear")
    again = linear(x[0], w)                       # another signature of the same call: a new plan
    assert_close(again.double().cpu().numpy(), ref[0].cpu().numpy(), TOL["bfloat16"], "torch linear 2-D")


@pytest.mark.parametrize("M, N, K, layout, dtype", [(300, 1031, 136, "out_in", "bfloat16"),
                                                   (64, 50257, 64, "out_in", "bfloat16"),
                                                   (5, 200, 72, "in_out", "float32")])
def test_linear_into_padded_rows(M, N, K, layout, dtype):
    """An out whose rows are padded (a [..., :N] slice, as forward()'s logits): the rows are written,
    the padding past each row's next 16-byte boundary is not (the vector store of a row's last
    elements may write zeros up to it), and a 3-D view of such rows works the same."""
    padded = -(-N // 64) * 64 + 64
    x = rand((2, M, K), dtype)
    w = rand((K, N) if layout == "in_out" else (N, K), dtype, 1 / math.sqrt(K))
    buf = poisoned((2, M, padded), dtype)
    y = linear(x, w, weight_layout=layout, out=buf[:, :, :N])
    ref = linear_reference(host(x), host(w), weight_layout=layout)
    assert_close(host(y), ref, TOL[dtype], f"linear into padded rows {(M, N, K, layout, dtype)}")
    vector = 16 // np.dtype(np.float32 if dtype == "float32" else np.float16).itemsize
    boundary = -(-N // vector) * vector
    assert np.isnan(host(buf[:, :, boundary:])).all(), "linear wrote past the 16-byte boundary of its rows"
    row = buf[1, :, :N]                                                     # 2-D padded rows
    linear(x[1], w, weight_layout=layout, out=row)
    assert_close(host(row), ref[1], TOL[dtype], "linear into 2-D padded rows")


def test_persistent_linear_plan_launches_ordinarily():
    x, w = rand((512, 256), "bfloat16"), rand((256, 512), "bfloat16", 1 / 16)
    base = dict(TM=128, TN=128, TK=64, GROUP_M=8, SPLIT_K=1, occupancy=1, num_ctas=1, num_worker_warps=8)
    for persistent in (1, 0):
        with LINEAR.pinned(dict(base, PERSISTENT=persistent)):
            plan, _ = LINEAR.plan_for((x, w, None, None, None), (None, "in_out", False))
            assert [launch[4] for launch in plan.launches] == [not persistent]
            assert_close(host(linear(x, w)), host(x) @ host(w), TOL["bfloat16"], f"persistent={persistent}")


@pytest.mark.parametrize("split_k", [2, 4, 8])
def test_split_k_partials_are_summed_by_the_last_arrival(split_k):
    """Split-K programs publish partial sums through an arrival counter the last one resets: repeated
    calls on fresh data stay right in every row (a lost ordering would show as a wrong tile)."""
    config = dict(TM=16, TN=64, TK=128, GROUP_M=8, SPLIT_K=split_k, PERSISTENT=0, occupancy=1, num_ctas=1,
                  num_worker_warps=0)
    with LINEAR.pinned(config):
        for M, K in [(1, 6400), (8, 1600), (3, 1024), (1, 1600), (8, 6400)]:
            check_linear(M, 777, K, "bfloat16", act="gelu", res=True)
            check_linear(M, 1600, K, "float32")


@pytest.mark.parametrize("TK", [32, 64])
def test_persistent_programs_cover_every_tile(TK):
    """A persistent grid (one program per SM) walks more tiles than it has programs, partial edge tiles
    and every epilogue included, in both weight layouts."""
    config = dict(TM=128, TN=256, TK=TK, GROUP_M=8, SPLIT_K=1, PERSISTENT=1, occupancy=1, num_ctas=1,
                  num_worker_warps=8)
    assert math.ceil(3000 / 128) * math.ceil(2500 / 256) > device_info().sm_count
    with LINEAR.pinned(config):
        for layout in ("in_out", "out_in"):
            check_linear(3000, 2500, 777, "bfloat16", layout, bias=True, act="gelu", res=True)
            check_linear(2049, 1031, 1600, "float16", layout, bias=False)


@pytest.mark.parametrize("M, N, K, layout, bias, act, res", [
    (5, 2000, 1000, "out_in", False, None, False), (300, 14000, 4000, "out_in", False, None, False),
    (2500, 3000, 1000, "out_in", False, None, True), (700, 2000, 700, "in_out", True, "gelu", False)])
def test_an_untuned_shape_runs_the_nearest_tuned_config(M, N, K, layout, bias, act, res, monkeypatch):
    """Shapes the shipped database lacks borrow the nearest tuned config of the same flags (this GPU's file or
    another sm_90 GPU's), a config the space admits for them, and compute the right thing with it."""
    monkeypatch.delenv("TILEKIT_SHIPPED_DB", raising=False)
    monkeypatch.delenv("TILEKIT_AUTOTUNE", raising=False)
    store.reset()
    problem = dict(dtype="bfloat16", M=M, N=N, K=K, wt="nk" if layout == "out_in" else "kn", bias=int(bias),
                   act=act or "none", res=int(res), tf32=0)
    found = LINEAR.resolve(problem, device_info(), "cached")
    assert found.source == "shipped" and found.match.rule in ("nearest bucket", "nearest shape"), found.describe()
    assert LINEAR.space.admits(found.config, LINEAR.tuning_problem(problem))
    x = rand((M, K), "bfloat16")
    w = rand((K, N) if layout == "in_out" else (N, K), "bfloat16", 1 / math.sqrt(K))
    b = rand((N,), "bfloat16") if bias else None
    r = rand((M, N), "bfloat16") if res else None
    plan, _ = LINEAR.plan_for((x, w, b, r, None), (act, layout, False))
    assert plan.config == found.config
    check_linear(M, N, K, "bfloat16", layout, bias, act, res)

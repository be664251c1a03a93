"""Each op against its float64 NumPy reference on the GPU: fresh random inputs, NaN-poisoned outputs."""

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.gpu.conftest import TOL, assert_close, host, poisoned, rand, rounded

cupy = pytest.importorskip("cupy")

from tilekit.autotune.compile import precompile  # noqa: E402
from tilekit.device import device_info  # noqa: E402
from tilekit.kernels import (attention, decode_attention, embedding, gelu, greedy_step, layer_norm,  # noqa: E402
                             linear, rms_norm, swiglu_linear)
from tilekit.kernels.attention import ATTENTION, attention_reference  # noqa: E402
from tilekit.kernels.decode_attention import DECODE_ATTENTION, decode_attention_reference  # noqa: E402
from tilekit.kernels.embedding import embedding_reference  # noqa: E402
from tilekit.kernels.tiles import fixed_to_float  # noqa: E402
from tilekit.kernels.gelu import GELU, gelu_reference  # noqa: E402
from tilekit.kernels.layer_norm import LAYER_NORM, layer_norm_reference  # noqa: E402
from tilekit.kernels.linear import LINEAR, linear_reference  # noqa: E402
from tilekit.kernels.rms_norm import RMS_NORM  # noqa: E402
from tilekit.kernels.apply_rope import APPLY_ROPE  # noqa: E402
from tilekit.kernels.greedy_step import GREEDY_STEP, greedy_reference  # noqa: E402
from tilekit.kernels.swiglu_linear import SWIGLU_LINEAR  # noqa: E402
from tests.gpu.test_llama_kernels import check_rms_norm, check_rope, check_swiglu_linear  # noqa: E402
from tilekit.kernels.residual_linear import RESIDUAL_LINEAR  # noqa: E402
from tests.gpu.test_residual import check_layer_norm_of_fixed_point, check_residual_linear  # noqa: E402

GPU = settings(max_examples=12, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


# -- linear ----------------------------------------------------------------------------------

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


# -- every sampled config of every space is correct -------------------------------------------

SPACE_CASES = {
    "linear": dict(dtype="bfloat16", M=300, N=200, K=136, wt="kn", bias=1, act="gelu", res=1, tf32=0),
    "linear_many_rows": dict(dtype="bfloat16", M=1500, N=1000, K=520, wt="nk", bias=1, act="gelu", res=1, tf32=0),
    "linear_split_k": dict(dtype="bfloat16", M=5, N=1000, K=1536, wt="kn", bias=1, act="gelu", res=1, tf32=0),
    "layer_norm": dict(dtype="bfloat16", M=37, N=1600, gather=0, fixed=0),
    "gelu": dict(dtype="bfloat16", n=10007, exact=0),
    "attention": dict(dtype="bfloat16", B=2, H=3, Hkv=3, Tq=300, Tk=300, D=64, causal=1),
    "attention_gqa": dict(dtype="bfloat16", B=2, H=8, Hkv=2, Tq=300, Tk=300, D=64, causal=1),
    "decode_attention": dict(dtype="bfloat16", B=2, H=3, Hkv=3, nq=1, capacity=700, D=64, new_kv=1),
    "decode_attention_gqa": dict(dtype="bfloat16", B=2, H=8, Hkv=2, nq=3, capacity=700, D=128, new_kv=1),
    "greedy": dict(dtype="bfloat16", B=3, V=50257, L=16),
    "rms_norm": dict(dtype="bfloat16", M=37, N=2048, gather=0, res=1),
    "rope": dict(dtype="bfloat16", table="float32", B=2, H=6, T=77, D=64),
    "swiglu_linear": dict(dtype="bfloat16", M=300, N=200, K=136),
    "swiglu_linear_few_rows": dict(dtype="bfloat16", M=3, N=1000, K=512),
    "layer_norm_fixed": dict(dtype="bfloat16", M=3, N=1600, gather=0, fixed=1),
    "residual_linear": dict(dtype="bfloat16", M=3, N=1000, K=1600, bias=1),
}
OPS = {"linear": LINEAR, "linear_many_rows": LINEAR, "linear_split_k": LINEAR, "layer_norm": LAYER_NORM,
       "gelu": GELU, "attention": ATTENTION, "attention_gqa": ATTENTION, "decode_attention": DECODE_ATTENTION,
       "decode_attention_gqa": DECODE_ATTENTION, "greedy": GREEDY_STEP, "rms_norm": RMS_NORM, "rope": APPLY_ROPE,
       "swiglu_linear": SWIGLU_LINEAR, "swiglu_linear_few_rows": SWIGLU_LINEAR, "layer_norm_fixed": LAYER_NORM,
       "residual_linear": RESIDUAL_LINEAR}


def sampled_configs(name, k=5):
    op, p = OPS[name], SPACE_CASES[name]
    candidates = op.space.candidates(op.tuning_problem(p))
    picks = random.Random(0).sample(candidates, min(k, len(candidates)))
    return [op.default(p)] + [c for c in picks if c != op.default(p)]


@pytest.fixture(scope="module")
def precompiled_space_samples():
    """Fill cuTile's disk cache for the sampled configs in parallel before measuring them."""
    tasks = [(OPS[name], OPS[name].tuning_problem(p), c)
             for name, p in SPACE_CASES.items() for c in sampled_configs(name)]
    precompile(tasks, device_info().arch)


def run_case(name):
    p = SPACE_CASES[name]
    if name.startswith("linear"):
        check_linear(p["M"], p["N"], p["K"], p["dtype"], act="gelu", res=True)
    elif name == "layer_norm":
        check_layer_norm((p["M"], p["N"]), p["dtype"])
    elif name == "layer_norm_fixed":
        check_layer_norm_of_fixed_point(p["M"], p["N"], p["dtype"])
    elif name == "residual_linear":
        check_residual_linear(p["M"], p["N"], p["K"], p["dtype"])
    elif name == "gelu":
        check_gelu((p["n"],), p["dtype"], "tanh")
    elif name.startswith("attention"):
        check_attention(p["B"], p["H"], p["Tq"], p["Tk"], p["D"], p["dtype"], True, p["Hkv"])
    elif name.startswith("decode_attention"):
        check_decode(p["B"], p["H"], p["nq"], p["capacity"], p["D"], p["dtype"], p["Hkv"], new_kv=True)
    elif name == "greedy":
        check_greedy(p["B"], p["V"], p["L"], p["dtype"])
    elif name == "rms_norm":
        check_rms_norm((p["M"], p["N"]), p["dtype"], residual=True)
    elif name == "rope":
        check_rope(p["B"], p["H"] - 2, 2, p["T"], p["D"], p["dtype"])
    elif name.startswith("swiglu_linear"):
        check_swiglu_linear(p["M"], p["N"], p["K"], p["dtype"])


@pytest.mark.parametrize("name", list(SPACE_CASES))
def test_sampled_configs_are_correct(name, precompiled_space_samples):
    for config in sampled_configs(name):
        with OPS[name].pinned(config):
            run_case(name)


# -- layer_norm, gelu ------------------------------------------------------------------------

def check_layer_norm(shape, dtype, eps=1e-5):
    x = rand(shape, dtype, 2.0, mean=0.5)
    w = rand(shape[-1:], dtype)
    b = rand(shape[-1:], dtype)
    out = poisoned(shape, dtype)
    layer_norm(x, w, b, eps, out=out)
    assert_close(host(out), layer_norm_reference(host(x), host(w), host(b), eps), TOL[dtype], f"layer_norm {shape}")


@GPU
@given(shape=st.sampled_from([(1, 768), (3, 7, 1600), (8191, 768), (5, 20000), (2, 1)]), dtype=DTYPES)
def test_layer_norm_matches_reference(shape, dtype):
    check_layer_norm(shape, dtype)


def check_gelu(shape, dtype, approximate):
    x = rand(shape, dtype, 3.0)
    out = poisoned(shape, dtype)
    gelu(x, approximate=approximate, out=out)
    ref = rounded(gelu_reference(host(x), approximate), dtype)   # GELU's tail underflows fp16 (gelu(-6.45) ~ 1e-12)
    assert_close(host(out), ref, TOL[dtype], f"gelu {shape} {dtype} {approximate}")


@GPU
@given(shape=st.sampled_from([(1,), (1000,), (3, 333), ((1 << 20) + 3,)]), dtype=DTYPES,
       approximate=st.sampled_from(["tanh", "none"]))
def test_gelu_matches_reference(shape, dtype, approximate):
    check_gelu(shape, dtype, approximate)


# -- attention -------------------------------------------------------------------------------

def check_attention(B, H, Tq, Tk, D, dtype, causal, Hkv=None):
    """q, k, v as strided views of one fused QKV buffer, the way GPT-2 (Hkv = H) and Llama call it."""
    Hkv = H if Hkv is None else Hkv
    heads = rand((B, Tk, H + 2 * Hkv, D), dtype).transpose(0, 2, 1, 3)
    q, k, v = heads[:, :H, Tk - Tq:], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    out = poisoned((B, Tq, H, D), dtype).transpose(0, 2, 1, 3)
    attention(q, k, v, causal=causal, out=out)
    ref = attention_reference(host(q), host(k), host(v), causal=causal)
    assert_close(host(out), ref, TOL[dtype], f"attention {(B, H, Hkv, Tq, Tk, D, dtype, causal)}")


@GPU
@given(T=st.sampled_from([1, 7, 64, 1023, 1025]), D=st.sampled_from([64, 128, 80]),
       dtype=st.sampled_from(["bfloat16", "float16"]), causal=st.booleans())
def test_attention_matches_reference(T, D, dtype, causal):
    check_attention(2, 3, T, T, D, dtype, causal)


def test_attention_fp32_and_shorter_queries():
    check_attention(1, 2, 5, 77, 64, "float32", True)
    check_attention(2, 1, 33, 40, 64, "bfloat16", False)


@pytest.mark.parametrize("longest_first", [0, 1])
def test_attention_grid_orders(longest_first):
    """Both grid orders cover every (query tile, batch, head) once: several query tiles, grouped heads,
    fewer queries than keys, with and without the causal mask."""
    with ATTENTION.pinned(dict(BM=64, BN=64, LONGEST_FIRST=longest_first, occupancy=2)):
        check_attention(3, 4, 300, 300, 64, "bfloat16", True, Hkv=2)
        check_attention(2, 3, 130, 333, 64, "float16", True)
        check_attention(2, 3, 200, 200, 128, "bfloat16", False)


@pytest.mark.parametrize("H,Hkv,T,D,dtype", [(8, 2, 300, 64, "bfloat16"), (32, 8, 129, 128, "bfloat16"),
                                             (4, 1, 65, 64, "float32"), (6, 3, 1, 64, "float16")])
def test_grouped_query_attention(H, Hkv, T, D, dtype):
    check_attention(2, H, T, T, D, dtype, True, Hkv)
    check_attention(1, H, max(1, T // 3), T, D, dtype, True, Hkv)


# -- decode attention, KV cache, embedding, greedy -------------------------------------------

def check_decode(B, H, nq, capacity, D, dtype, Hkv=None, new_kv=False, lengths_h=None, rng=np.random.default_rng(0)):
    """With new_kv, the new tokens' keys and values come as views of a fused QKV buffer (as the models
    pass them) and must land in the caches, every other cache position untouched."""
    Hkv = H if Hkv is None else Hkv
    kc = rand((B, Hkv, capacity, D), dtype)
    vc = rand((B, Hkv, capacity, D), dtype)
    if new_kv:
        heads = rand((B, nq, H + 2 * Hkv, D), dtype).transpose(0, 2, 1, 3)
        q, k_new, v_new = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    else:
        q, k_new, v_new = rand((B, H, nq, D), dtype), None, None
    if lengths_h is None:
        lengths_h = rng.integers(nq, capacity + 1, B).astype(np.int32)
        lengths_h[0] = capacity
    new = {} if k_new is None else dict(new_k=host(k_new), new_v=host(v_new))
    ref = decode_attention_reference(host(q), host(kc), host(vc), lengths_h, **new)
    expected_k, expected_v = host(kc), host(vc)
    for b, n in enumerate(lengths_h if new_kv else ()):
        expected_k[b, :, n - nq:n], expected_v[b, :, n - nq:n] = new["new_k"][b], new["new_v"][b]
    out = poisoned((B, H, nq, D), dtype)
    decode_attention(q, kc, vc, cupy.asarray(lengths_h), new_k=k_new, new_v=v_new, out=out)
    assert_close(host(out), ref, TOL[dtype], f"decode_attention {(B, H, Hkv, nq, capacity, D, dtype, new_kv)}")
    assert np.array_equal(host(kc), expected_k) and np.array_equal(host(vc), expected_v), "KV cache contents"
    return q, kc, vc, lengths_h, out


@pytest.mark.parametrize("B,H,Hkv,nq,capacity,D,dtype", [(1, 32, 8, 1, 1024, 64, "bfloat16"),
                                                          (3, 32, 8, 2, 300, 128, "bfloat16"),
                                                          (2, 14, 2, 3, 100, 64, "float32"),
                                                          (1, 8, 1, 1, 4100, 128, "float16")])
def test_grouped_query_decode_attention(B, H, Hkv, nq, capacity, D, dtype):
    check_decode(B, H, nq, capacity, D, dtype, Hkv)
    check_decode(B, H, nq, capacity, D, dtype, Hkv, new_kv=True)


@pytest.mark.parametrize("chunk,BN", [(256, 64), (256, 128), (256, 256)])
def test_decode_splits_merge_and_write_new_keys_at_every_boundary(chunk, BN):
    """Pinned to several splits: the new tokens end on, start on and straddle split boundaries, and
    the merge launch combines the splits (repeated calls on fresh data)."""
    config = dict(BN=BN, CHUNK=chunk, occupancy=2)
    with DECODE_ATTENTION.pinned(config):
        for nq in (1, 3):
            lengths = np.array([chunk, chunk + 1, chunk + nq, 2 * chunk + nq - 2, 600, nq], np.int32)
            for _ in range(2):
                check_decode(6, 8, nq, 600, 64, "bfloat16", 2, new_kv=True, lengths_h=lengths)
                if BN <= 128:                                   # the space keeps fp32 to 128-key tiles
                    check_decode(6, 4, nq, 600, 64, "float32", new_kv=False, lengths_h=lengths)


@GPU
@given(B=st.sampled_from([1, 3, 32]), nq=st.sampled_from([1, 3]), capacity=st.sampled_from([100, 1024, 4100]),
       dtype=st.sampled_from(["bfloat16", "float32"]))
def test_decode_attention_matches_reference(B, nq, capacity, dtype):
    check_decode(B, 4, nq, capacity, 64, dtype)
    check_decode(B, 4, nq, capacity, 64, dtype, new_kv=True)


def test_decode_attention_length_offset():
    q = rand((2, 2, 1, 64), "bfloat16")
    kc, vc = rand((2, 2, 50, 64), "bfloat16"), rand((2, 2, 50, 64), "bfloat16")
    cached = np.array([9, 30], np.int32)
    out = decode_attention(q, kc, vc, cupy.asarray(cached), length_offset=1)
    ref = decode_attention_reference(host(q), host(kc), host(vc), cached + 1)
    assert_close(host(out), ref, TOL["bfloat16"], "decode_attention length_offset")
    k_new, v_new = rand((2, 2, 1, 64), "bfloat16"), rand((2, 2, 1, 64), "bfloat16")
    ref = decode_attention_reference(host(q), host(kc), host(vc), cached + 1, new_k=host(k_new), new_v=host(v_new))
    out = decode_attention(q, kc, vc, cupy.asarray(cached), new_k=k_new, new_v=v_new, length_offset=1)
    assert_close(host(out), ref, TOL["bfloat16"], "decode_attention length_offset new_kv")
    for b, n in enumerate(cached):            # written at the newest position, lengths + offset - 1
        assert np.array_equal(host(kc)[b, :, n], host(k_new)[b, :, 0])


@pytest.mark.parametrize("module", ["layer_norm", "gelu", "linear", "attention", "decode_attention", "write_kv",
                                    "embedding", "greedy_step", "rms_norm", "apply_rope", "swiglu_linear",
                                    "residual_linear"])
def test_each_op_module_checks_itself(module):
    """`python -m tilekit.kernels.<op>`: the op's own check against its reference (write_kv's is the
    KV-cache write test, clipping included)."""
    import runpy
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # runpy: the module is also imported
        runpy.run_module(f"tilekit.kernels.{module}", run_name="__main__")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_embedding(dtype):
    V, P, C = 1031, 64, 1600
    wte, wpe = rand((V, C), dtype), rand((P, C), dtype)
    ids = cupy.random.randint(0, V, (3, 17)).astype(cupy.int32)
    pos = cupy.random.randint(0, P, (3, 17)).astype(cupy.int32)
    out = poisoned((3, 17, C), dtype)
    embedding(ids, wte, wpe, pos, out=out)
    assert_close(host(out), embedding_reference(host(ids), host(wte), host(wpe), host(pos)), TOL[dtype], "embedding")
    fixed_point = cupy.full((3, 17, C), -(1 << 62), cupy.int64)            # poisoned
    embedding(ids, wte, wpe, pos, out=fixed_point)
    ref = embedding_reference(host(ids), host(wte), host(wpe), host(pos))
    assert_close(fixed_to_float(cupy.asnumpy(fixed_point)), ref, TOL[dtype], "embedding into a fixed-point residual")
    default_pos = embedding(ids, wte, wpe)
    assert_close(host(default_pos), embedding_reference(host(ids), host(wte), host(wpe),
                                                        np.broadcast_to(np.arange(17), (3, 17))), TOL[dtype],
                 "embedding, default positions")


def check_greedy(B, V, L, dtype):
    logits = rand((B, V), dtype)
    tokens = cupy.full((B,), -5, cupy.int32)
    positions = cupy.asarray(np.arange(B, dtype=np.int32) % (L - 1))
    history = cupy.zeros((B, L), cupy.int32)
    finished = cupy.asarray((np.arange(B) == 1).astype(np.int32))    # row 1 is already done
    expected = greedy_reference(host(logits))
    eos = int(expected[0])
    greedy_step(logits, tokens, positions, history, finished, eos_id=eos)
    got = host(tokens)
    want = np.where(np.arange(B) == 1, eos, expected)
    assert got.tolist() == want.tolist()
    new_pos = np.arange(B) % (L - 1) + 1
    assert host(positions).tolist() == new_pos.tolist()
    assert host(history)[np.arange(B), new_pos].tolist() == want.tolist()
    assert host(finished).tolist() == (want == eos).astype(int).tolist()


@pytest.mark.parametrize("B,V", [(1, 50257), (4, 1031), (9, 50257)])
def test_greedy_step(B, V):
    check_greedy(B, V, 16, "float32")


# -- bad input is refused before launch ------------------------------------------------------

def test_bad_inputs_name_the_argument():
    x = rand((4, 64), "bfloat16")
    w = rand((64, 32), "bfloat16")
    with pytest.raises(TypeError, match="x must be a CUDA device array"):
        linear(np.zeros((4, 64), np.float32), w)
    with pytest.raises(TypeError, match="weight has dtype float32"):
        linear(x, rand((64, 32), "float32"))
    with pytest.raises(ValueError, match="weight shape"):
        linear(x, rand((63, 32), "bfloat16"))
    with pytest.raises(ValueError, match="weight must be 2-D"):
        linear(x, rand((64,), "bfloat16"))
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        linear(rand((64, 4), "bfloat16").T, w)
    with pytest.raises(ValueError, match="bias must have shape"):
        linear(x, w, rand((31,), "bfloat16"))
    with pytest.raises(ValueError, match="activation"):
        linear(x, w, activation="relu")
    with pytest.raises(ValueError, match="head_dim 512 is not supported"):
        q = rand((1, 1, 4, 512), "bfloat16")
        attention(q, q, q)
    with pytest.raises(ValueError, match="q must be 4-D"):
        attention(x, x, x)
    for scale in (0.0, -0.125, math.inf, "0.1"):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            q = rand((1, 1, 4, 64), "bfloat16")
            attention(q, q, q, scale=scale)
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm(x, rand((63,), "bfloat16"), rand((64,), "bfloat16"))
    with pytest.raises(TypeError, match="lengths has dtype int64"):
        q = rand((1, 2, 1, 64), "bfloat16")
        kv = rand((1, 2, 8, 64), "bfloat16")
        decode_attention(q, kv, kv, cupy.zeros((1,), cupy.int64))
    with pytest.raises(ValueError, match="pass both new_k and new_v"):
        decode_attention(q, kv, kv, cupy.zeros((1,), cupy.int32), new_k=q)
    with pytest.raises(ValueError, match="new_k must have shape"):
        decode_attention(q, kv, kv, cupy.zeros((1,), cupy.int32), new_k=kv, new_v=kv)
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            w1 = rand((64, 32), "bfloat16")
        with pytest.raises(ValueError, match="GPU"):
            linear(x, w1)


def test_layer_norm_selected_rows():
    x = rand((5, 9, 768), "bfloat16", 2.0, mean=0.3)
    w, b = rand((768,), "bfloat16"), rand((768,), "bfloat16")
    rows = np.array([8, 17, 44, 0], np.int32)
    out = poisoned((4, 768), "bfloat16")
    layer_norm(x, w, b, rows=cupy.asarray(rows), out=out)
    ref = layer_norm_reference(host(x).reshape(45, 768)[rows], host(w), host(b))
    assert_close(host(out), ref, TOL["bfloat16"], "layer_norm rows")


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


# -- the launch path ---------------------------------------------------------------------------

def test_empty_problems_launch_nothing_and_return_empty_results():
    x = rand((4, 64), "bfloat16")
    assert linear(x, rand((64, 0), "bfloat16")).shape == (4, 0)
    assert linear(rand((0, 64), "bfloat16"), rand((64, 8), "bfloat16")).shape == (0, 8)
    ids = cupy.zeros((2, 3), cupy.int32)
    assert embedding(ids, rand((10, 0), "bfloat16"), rand((8, 0), "bfloat16")).shape == (2, 3, 0)
    assert layer_norm(rand((0, 64), "bfloat16"), rand((64,), "bfloat16"), rand((64,), "bfloat16")).shape == (0, 64)
    assert rms_norm(rand((0, 64), "bfloat16"), rand((64,), "bfloat16")).shape == (0, 64)
    assert swiglu_linear(rand((0, 64), "bfloat16"), rand((8, 64), "bfloat16"), rand((8, 64), "bfloat16")).shape == (0, 8)
    q = rand((0, 2, 5, 64), "bfloat16")
    assert attention(q, q, q).shape == (0, 2, 5, 64)
    q0, kv0 = rand((0, 2, 1, 64), "bfloat16"), rand((0, 2, 8, 64), "bfloat16")
    assert decode_attention(q0, kv0, kv0, cupy.zeros((0,), cupy.int32)).shape == (0, 2, 1, 64)
    none = cupy.zeros((0,), cupy.int32)
    greedy_step(rand((0, 50), "bfloat16"), none, none, cupy.zeros((0, 4), cupy.int32), none)   # no rows
    with pytest.raises(ValueError, match="no positions"):
        q1 = rand((1, 2, 1, 64), "bfloat16")
        decode_attention(q1, rand((1, 2, 0, 64), "bfloat16"), rand((1, 2, 0, 64), "bfloat16"),
                         cupy.zeros((1,), cupy.int32))
    with pytest.raises(ValueError, match="no vocabulary"):
        one = cupy.zeros((1,), cupy.int32)
        greedy_step(rand((1, 0), "bfloat16"), one, one, cupy.zeros((1, 4), cupy.int32), one)
    cupy.cuda.runtime.deviceSynchronize()


@pytest.mark.parametrize("stream", ["legacy default", "per-thread default"])
def test_threads_sharing_a_stream_handle_never_share_scratch(stream):
    """Eager split-KV decode attention from several threads on one stream handle (the legacy default
    stream, or each thread's per-thread default stream, which all share handle 2): each thread's
    partial sums are its own, so every result is right."""
    import threading
    errors = []

    def work(seed):
        try:
            with (cupy.cuda.Stream.null if stream == "legacy default" else cupy.cuda.Stream.ptds):
                for _ in range(5):
                    check_decode(2, 4, 1, 1024, 64, "bfloat16", rng=np.random.default_rng(seed))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_a_plan_hit_launches_with_the_new_arrays():
    """The second call of a signature reuses its plan: same shapes, new data and output, right answers."""
    for _ in range(3):
        check_linear(37, 200, 136, "bfloat16", act="gelu", res=True)
        check_layer_norm((37, 768), "bfloat16")
        check_attention(2, 3, 64, 64, 64, "bfloat16", True)

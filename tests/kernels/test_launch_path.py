"""The launch path on the GPU for every op: bad inputs named before anything launches, empty problems, per-stream
scratch shared by no two threads, plan hits with new arrays."""

import math

import cupy
import numpy as np
import pytest

from tests.kernels.test_attention import check_attention
from tests.kernels.test_decode_attention import check_decode
from tests.kernels.test_layer_norm import check_layer_norm
from tests.kernels.test_linear import check_linear
from tilekit.kernels import (attention, decode_attention, embedding, layer_norm, linear, next_token, rms_norm,
                             swiglu_linear)
from tilekit.kernels.checks import rand

pytestmark = pytest.mark.gpu


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
    eos = cupy.full((1,), -1, cupy.int32)
    next_token(rand((0, 50), "bfloat16"), cupy.zeros((0, 6), cupy.float32), cupy.zeros((0, 4), cupy.int32), eos,
               none, none, cupy.zeros((0, 4), cupy.int32), none)   # no rows
    with pytest.raises(ValueError, match="no positions"):
        q1 = rand((1, 2, 1, 64), "bfloat16")
        decode_attention(q1, rand((1, 2, 0, 64), "bfloat16"), rand((1, 2, 0, 64), "bfloat16"),
                         cupy.zeros((1,), cupy.int32))
    with pytest.raises(ValueError, match="no vocabulary"):
        one = cupy.zeros((1,), cupy.int32)
        next_token(rand((1, 0), "bfloat16"), cupy.zeros((1, 6), cupy.float32), cupy.zeros((1, 4), cupy.int32), eos,
                   one, one, cupy.zeros((1, 4), cupy.int32), one)
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

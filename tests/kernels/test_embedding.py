"""embedding on the GPU against its float64 reference: with and without positions, into a fixed-point residual."""

import cupy
import numpy as np
import pytest

from tilekit.kernels import embedding
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
from tilekit.kernels.embedding import embedding_reference
from tilekit.kernels.tiles import fixed_to_float

pytestmark = pytest.mark.gpu


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_embedding_without_positions(dtype):
    wte = rand((1031, 2048), dtype)
    ids = cupy.random.randint(0, 1031, (3, 17)).astype(cupy.int32)
    out = embedding(ids, wte, out=poisoned((3, 17, 2048), dtype))
    np.testing.assert_array_equal(host(out), embedding_reference(host(ids), host(wte)))

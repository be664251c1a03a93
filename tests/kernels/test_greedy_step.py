"""greedy_step on the GPU against its reference: argmax, history and finished flags."""

import cupy
import numpy as np
import pytest

from tilekit.kernels import greedy_step
from tilekit.kernels.checks import host, rand
from tilekit.kernels.greedy_step import greedy_reference

pytestmark = pytest.mark.gpu


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

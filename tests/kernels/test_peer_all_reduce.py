"""The one-shot peer all-reduce (tilekit.kernels.peer_all_reduce through parallel.NcclCommunicator) on two GPUs of
one host: sums of fresh random bf16 / fp16 / fp32 / int64 arrays against float64 (int64 exactly), eager, back to
back and replayed from a CUDA graph, the fused RMSNorm against its reference, calls queued across the wrap of the
call counters, and every rank holding the same bits. The kernel also compiles for sm_90 and sm_100 on a CPU
(tests/kernels/test_compile.py)."""

import sys

import numpy as np
import pytest

from tests.models.test_tensor_parallel_gpu import need_gpus

cupy = pytest.importorskip("cupy")

from tilekit import parallel  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [2, 4])
def test_peer_sums_equal_float64_on_every_rank(tmp_path, monkeypatch, world):
    need_gpus(world)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("TILEKIT_PEER_ALL_REDUCE_BYTES", str(1 << 20))      # the default, whatever the caller set
    status = parallel.launch(world, ["-m", "tests.kernels.peer_all_reduce_worker", str(tmp_path)],
                             program=[sys.executable], quiet_ranks=False)
    assert status == 0, status
    per_rank = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]
    assert per_rank[0]["peer"], "the ranks did not take the peer path (no peer access between the GPUs?)"
    print("\n".join(per_rank[0]["worst"]))
    for rank in range(1, world):
        for key in per_rank[0]:
            np.testing.assert_array_equal(per_rank[rank][key], per_rank[0][key], err_msg=f"rank {rank} {key}")

"""One rank of test_peer_all_reduce.py (started by parallel.launch):

    python -m tests.kernels.peer_all_reduce_worker OUT_DIR

joins the group, then all-reduces fresh random arrays of several shapes and dtypes through NcclCommunicator (the
peer path for these sizes), eagerly, back to back (also with no host sync between calls of different shapes), and
replayed from a CUDA graph, with and without the fused RMSNorm. Every rank makes the same inputs for every rank
from the same seeds, so each checks its sums against a float64 reference itself; it writes OUT_DIR/rank<R>.npz
with its outputs (the test compares the ranks' bits) and the worst errors."""

import faulthandler
import os
import sys
from pathlib import Path

import numpy as np

from tilekit import parallel
from tilekit.autotune.arrays import random_array
from tilekit.kernels.checks import TOL, assert_close, host, poisoned
from tilekit.kernels.rms_norm import rms_norm_reference

CASES = [((1, 4096), "bfloat16"), ((8, 4096), "bfloat16"), ((32, 4096), "bfloat16"), ((3, 1000), "float32"),
         ((2, 5, 768), "float16"), ((8, 2048), "int64"), ((1, 16384), "bfloat16"), ((200, 96), "float32")]
MIXED = [((1, 4096), "bfloat16"), ((32, 4096), "bfloat16"), ((8, 2048), "int64"), ((7, 300), "float32"),
         ((128, 4096), "bfloat16")]
NORM_CASES = [((1, 4096), "bfloat16"), ((8, 8192), "bfloat16"), ((5, 1000), "float32")]


def inputs(shape, dtype, world: int, call: int):
    """Every rank's input of one call, rank r's from seed (call, r): normal values, or integers of the fixed-point
    residual stream's range."""
    import cupy
    if dtype == "int64":
        return [cupy.asarray(np.random.default_rng((call, r)).integers(-2**40, 2**40, shape)) for r in range(world)]
    device = cupy.cuda.runtime.getDevice()
    return [random_array(tuple(shape), dtype, device, cupy.random.default_rng(call * 1000 + r)) for r in range(world)]


def check_sum(got, parts, dtype: str, what: str) -> float:
    """got against the sum of every rank's part: exact for int64, else within the dtype's tolerance of float64 (row
    by row); returns the relative error."""
    if dtype == "int64":
        assert np.array_equal(host(got), sum(host(p) for p in parts)), what
        return 0.0
    return assert_close(host(got), sum(host(p).astype(np.float64) for p in parts), TOL[dtype], what)


def queued_sums(comm, call: int, count: int, label: str) -> dict:
    """`count` all-reduces of the MIXED cases (inputs of calls call + 1, ...) queued back to back with no host sync
    between them, then each checked against float64; label k -> its sum."""
    queue = []
    for k in range(count):
        shape, dtype = MIXED[k % len(MIXED)]
        parts = inputs(shape, dtype, comm.world_size, call + 1 + k)
        got = parts[comm.rank].copy()
        comm.all_reduce(got)
        queue.append((shape, dtype, parts, got))
    sums = {}
    for k, (shape, dtype, parts, got) in enumerate(queue):
        check_sum(got, parts, dtype, f"{label} {k} {shape} {dtype}")
        sums[f"{label} {k}"] = host(got)
    return sums


def main(out: str) -> None:
    import cupy
    faulthandler.dump_traceback_later(float(os.environ.get("TILEKIT_TEST_RANK_TIMEOUT", "200")), exit=True)
    comm = parallel.join(timeout=60)
    rank, world = comm.rank, comm.world_size
    results, worst = {"peer": np.array(comm.peers.usable)}, {}
    call = 0
    for shape, dtype in CASES:
        for repeat in range(3):                    # back to back: the inboxes alternate
            call += 1
            parts = inputs(shape, dtype, world, call)
            got = poisoned(shape, dtype) if dtype != "int64" else cupy.full(shape, -7, np.int64)
            comm.all_reduce(parts[rank], got)
            err = check_sum(got, parts, dtype, f"{shape} {dtype} call {call}")
            if dtype != "int64":
                worst[f"{dtype} {shape}"] = max(err, worst.get(f"{dtype} {shape}", 0.0))
            results[f"sum {shape} {dtype} {repeat}"] = host(got)
    for shape, dtype in NORM_CASES:
        call += 1
        parts = inputs(shape, dtype, world, call)
        weight = inputs(shape[-1:], dtype, 1, call + 1000)[0]
        x, y = parts[rank].copy(), poisoned(shape, dtype)
        fused = comm.all_reduce_norm(x, weight, 1e-5, y)
        assert fused, f"{shape} {dtype}: the norm was not fused"
        check_sum(x, parts, dtype, f"norm {shape} {dtype}: the sum")
        expected = rms_norm_reference(host(x), host(weight), 1e-5)     # of the stream as stored, as rms_norm
        err = assert_close(host(y), expected, TOL[dtype], f"norm {shape} {dtype}")
        worst[f"norm {dtype} {shape}"] = err
        results[f"norm {shape} {dtype}"] = host(y)
    # back to back with no host sync between calls of different shapes and dtypes (as a model's step makes them):
    # each call's rows must not land where a peer still reads the previous call's
    results.update(queued_sums(comm, call, 24, "mixed"))
    call += 24
    # a captured graph of two all-reduces and a fused norm, replayed with new inputs each time
    shape, dtype = (4, 4096), "bfloat16"
    a, b, y = poisoned(shape, dtype), poisoned(shape, dtype), poisoned(shape, dtype)
    weight = inputs(shape[-1:], dtype, 1, 9999)[0]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:                          # everything on the captured stream (it does not wait for the default one)
        stream.begin_capture()
        comm.all_reduce(a)
        comm.all_reduce_norm(b, weight, 1e-5, y)
        graph = stream.end_capture()
        for replay in range(20):
            call += 1
            pa, pb = inputs(shape, dtype, world, call), inputs(shape, dtype, world, call + 5000)
            a[...], b[...] = pa[rank], pb[rank]
            graph.launch(stream)
            stream.synchronize()
            check_sum(a, pa, dtype, f"replay {replay}: a")
            check_sum(b, pb, dtype, f"replay {replay}: b")
            assert_close(host(y), rms_norm_reference(host(b), host(weight), 1e-5), TOL[dtype], f"replay {replay}: y")
            results[f"graph {replay}"] = host(y)
    del graph
    # the per-program call counters wrapping past 2**31 - 1 (about 30 hours of decode): calls queued back to back
    # across the wrap (a rank may run a call ahead of a peer there) sum right
    if comm.peers.usable:
        cupy.cuda.Device().synchronize()
        comm.barrier()                      # no call in flight on any rank while the counters are set
        comm.peers.epochs[...] = 2 ** 31 - 4
        results.update(queued_sums(comm, call, 8, "wrap"))
        assert int(comm.peers.epochs.max()) < 0, "the counters did not wrap"
    results["worst"] = np.array([f"{k}: {v:.2e}" for k, v in sorted(worst.items())])
    np.savez(Path(out) / f"rank{rank}.npz", **results)
    comm.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

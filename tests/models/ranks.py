"""Tensor-parallel ranks as threads of one parallel.ThreadGroup, for the families' CPU tests of their sharded step
code (tests/models/<family>/test_tensor_parallel.py)."""

import threading

import pytest

from tilekit import parallel
from tilekit import checkpoints as hf


def on_ranks(world: int, fn, timeout: float = 60.0) -> list:
    """fn(communicator) on `world` threads of one ThreadGroup; their results in rank order (the first error
    raised; a failing rank aborts the group so that the others do not wait for it)."""
    group = parallel.ThreadGroup(world, timeout=timeout)
    results, errors = [None] * world, []

    def body(rank):
        try:
            results[rank] = fn(group.communicator(rank))
        except BaseException as e:   # noqa: BLE001 - handed back to the test
            errors.append(e)
            group.abort()
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * timeout)
    assert not any(t.is_alive() for t in threads), "hung"
    if errors:
        raise errors[0]
    return results


def assert_seeded_models_refused(model_class, config, quantized_refused: bool) -> None:
    """A sharded model's weights come from a checkpoint (every rank a slice of the same ones); its linears are
    quantized only where the family shards them (`quantized_refused`: it does not)."""
    with pytest.raises(ValueError, match="come from state= or a checkpoint"):
        model_class(config, dtype="float32", comm=parallel.ShapeOnly(0, 2))
    assert model_class.shards_quantized is not quantized_refused
    if quantized_refused:
        with pytest.raises(ValueError, match=f"{model_class.__name__}'s tensor parallelism does not take quantized "
                                             "linears"):
            model_class(config, meta=True, quantize="int8", comm=parallel.ShapeOnly(0, 2))
    else:
        assert model_class(config, meta=True, quantize="int8", comm=parallel.ShapeOnly(0, 2)).quantized


def assert_a_failing_rank_stops_the_others(run) -> None:
    """run(comm) on two ranks, rank 1 raising first: the error reaches the caller instead of a hang."""
    def body(comm):
        if comm.rank == 1:
            raise RuntimeError("rank 1 broke")
        return run(comm)
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        on_ranks(2, body, timeout=20)


class ReadCounter:
    """The bytes of each tensor of a checkpoint the loader reads (hf.RegularFile.readinto recorded); clear() between
    loads."""

    def __init__(self, monkeypatch, checkpoint):
        self.reads = []
        original = hf.RegularFile.readinto

        def recording(file, view, offset):
            self.reads.append((offset, offset + len(view)))
            original(file, view, offset)
        monkeypatch.setattr(hf.RegularFile, "readinto", recording)
        with hf.Checkpoint.at(checkpoint).tensor_files() as files:
            self.spans = {name: (info.start, info.end) for name, info in files.tensors.items()}

    def clear(self) -> None:
        self.reads.clear()

    def size(self, name: str) -> int:
        start, end = self.spans[name]
        return end - start

    def read(self, name: str) -> int:
        start, end = self.spans[name]
        return sum(max(0, min(hi, end) - max(lo, start)) for lo, hi in self.reads)

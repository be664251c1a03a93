"""Tensor-parallel ranks as threads of one parallel.ThreadGroup, for the families' CPU tests of their sharded step
code (tests/models/<family>/test_tensor_parallel.py)."""

import threading

from tilekit import parallel


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

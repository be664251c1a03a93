"""A test helper: run a call that might block forever (the open of a FIFO) in a thread, and fail instead of hang."""

import threading


def run_briefly(fn, seconds=20):
    """fn()'s exception (or None) from a thread; fails the test if it does not finish (a blocking open of a FIFO)."""
    result = {}

    def target():
        try:
            fn()
        except BaseException as e:   # noqa: BLE001 - handed back to the test
            result["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "hung"
    return result.get("error")

"""A process that ran a model ends cleanly, however it ends (the script's end, sys.exit, an exception escaping,
Ctrl-C, a model still referenced from a global, several models, a tensor-parallel rank).

What a runner captured (CUDA graphs and their executable instances, the streams they were captured on, the work
arrays of those streams) must go while everything it refers to is alive: the cuTile kernels a graph launches and
the CUDA context. Left to interpreter shutdown, they are destroyed in whatever order module teardown reaches them,
after the kernels' modules may have been unloaded, and the process died with a segmentation fault (issue #59). So
every runner that captures registers here, and one atexit handler, registered once the first such runner exists (so
after CuPy and cuTile registered theirs: atexit runs the last registered first), releases them all, drops the
per-stream work arrays and the ops' launch plans, and waits for the GPU, before any module is torn down.
"""

from __future__ import annotations

import atexit
import threading
import weakref

_runners: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def track(runner) -> None:
    """Release `runner` (its release() method) before the interpreter shuts down, if it is still alive then."""
    global _registered
    with _lock:
        _runners.add(runner)
        if not _registered:
            atexit.register(release_all)
            _registered = True


def release_all() -> None:
    """Release every live runner, then the work arrays and launch plans that kernels keep per stream, and wait for
    the GPU: what atexit runs (callable any time; the runners stay usable and capture again when next used)."""
    with _lock:
        runners = list(_runners)
    for runner in runners:
        runner.release()
    from tilekit.autotune import arrays, store
    arrays.release_all_scratch()
    store.reset()
    import sys
    cupy = sys.modules.get("cupy")      # only where the process used the GPU
    if cupy is not None:
        try:
            cupy.cuda.runtime.deviceSynchronize()
        except cupy.cuda.runtime.CUDARuntimeError:      # a device already in error: nothing left to wait for
            pass

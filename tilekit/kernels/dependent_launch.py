"""Programmatic dependent launch: every tilekit kernel may start while the kernel before it finishes.

tilekit's launch path launches each kernel with programmatic_dependent_launch=True, so on Hopper
its programs can be scheduled, and prefetch what no earlier kernel writes (weights), while the
kernel before it on the stream is still running. Every kernel therefore calls
`sync_with_previous_kernel()` before it reads anything an earlier kernel may have written, and
before it writes anything at all. Launched without the flag (the tuner, a plain ct.launch), the
call costs nothing.
"""

from __future__ import annotations

import cuda.tile as ct


@ct.function
def sync_with_previous_kernel():
    """Let the next kernel on the stream be scheduled now, then wait until the previous kernel has
    finished and its writes are visible."""
    ct.grid_dependency_control_launch_dependents()
    ct.grid_dependency_control_wait()

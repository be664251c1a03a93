"""Timestamped progress lines on stderr, for the suites and studies."""

from __future__ import annotations

import sys
import time


class Log:
    """Timestamped progress lines on stderr."""

    def __init__(self, stream=None):
        self.t0 = time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=self.stream, flush=True)

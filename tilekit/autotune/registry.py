"""The ops declared so far, by name: op modules register themselves when they are imported, so the
autotune layer knows ops only through this registry (importing tilekit.kernels declares them all)."""

from __future__ import annotations

_ops: dict[str, object] = {}


def register(op) -> None:
    """Declare `op`; the first declaration of a name stays (running an op module as a script,
    `python -m tilekit.kernels.<op>`, declares a second copy, which must not replace the package's)."""
    _ops.setdefault(op.name, op)


def registered_ops() -> dict:
    return dict(_ops)

"""Where the tuning databases live: the user cache (writable) over the shipped tuning_db/ (read-only)."""

from __future__ import annotations

from pathlib import Path

from tilekit import env
from tilekit.autotune.db import TuningDB

_layers: list[TuningDB] | None = None


def user_dir() -> Path:
    """TILEKIT_CACHE_DIR, else the platform's user cache dir (e.g. ~/.cache/tilekit)."""
    path = env.cache_dir()
    if path is not None:
        return path
    import platformdirs
    return Path(platformdirs.user_cache_dir("tilekit", appauthor=False))


def shipped_dir() -> Path:
    """TILEKIT_SHIPPED_DB (an existing directory), else the tuning_db/ packaged with tilekit (or beside a source
    checkout)."""
    path = env.shipped_dir()
    if path is not None:
        return path
    packaged = Path(__file__).resolve().parent.parent / "tuning_db"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "tuning_db"


def layers() -> list[TuningDB]:
    """[user, shipped], created on first use from the environment. A user database that lies inside
    the shipped one (or holds it) is read-only too: no write may reach the shipped layer."""
    global _layers
    if _layers is None:
        user, shipped = user_dir() / "tuning", shipped_dir()
        _layers = [TuningDB(user, "user", writable=not _nested(user, shipped)),
                   TuningDB(shipped, "shipped", writable=False)]
    return _layers


def _nested(a: Path, b: Path) -> bool:
    """True when one directory is, or lies inside, the other (after resolving links)."""
    a, b = a.resolve(), b.resolve()
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def user_db() -> TuningDB:
    return layers()[0]


def shipped_db() -> TuningDB:
    return layers()[1]


def reset() -> None:
    """Re-read the environment and forget every in-process answer (tests, `db clear`, imports)."""
    global _layers
    _layers = None
    from tilekit.autotune.registry import registered_ops
    for op in registered_ops().values():
        op.forget()

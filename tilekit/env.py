"""The environment variables tilekit reads, each read here and checked: a bad value is an error naming the
variable. TILEKIT_AUTOTUNE, TILEKIT_DEPENDENT_LAUNCH, TILEKIT_CACHE_DIR and TILEKIT_SHIPPED_DB for the kernels'
tuning; HF_HUB_CACHE, HF_HOME and XDG_CACHE_HOME for the Hugging Face hub cache; RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT (torchrun's, also set by Slurm or mpirun wrappers) for tensor parallelism;
TILEKIT_API_KEY for `tilekit serve`. check() reads them all, for a command line to refuse a bad environment before
doing anything."""

from __future__ import annotations

import errno
import ipaddress
import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tilekit.untrusted import quoted

AUTOTUNE_MODES = ("off", "cached", "auto")


def expand_user(text: str, what: str) -> str:
    """`text` with a leading ~ or ~user expanded; FileNotFoundError naming `what` if that user does not exist, or
    for ~ when HOME is set but empty (Python would make ~/x the root's /x)."""
    if text.partition("/")[0] == "~" and os.environ.get("HOME", None) == "":
        raise FileNotFoundError(f"{what} {quoted(text)}: no home directory (HOME is empty)")
    expanded = os.path.expanduser(text)
    if text.startswith("~") and expanded == text:
        user = text[1:].partition("/")[0]
        raise FileNotFoundError(f"{what} {quoted(text)}: " + (f"no user {quoted(user)}" if user else
                                                               "no home directory"))
    return expanded


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Variable `name` (blanks stripped, lower case; unset or empty: `default`), which must be one of `choices`."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={quoted(raw)} is not one of {', '.join(choices)}")
    return value


def directory(name: str) -> Path | None:
    """The path variable `name` names (~ expanded), or None when it is unset or empty."""
    raw = os.environ.get(name, "")
    return Path(expand_user(raw, name)) if raw.strip() else None


def autotune_mode() -> str:
    """TILEKIT_AUTOTUNE: cached (default: use the databases), off (heuristic defaults) or auto (tune on a miss)."""
    return choice("TILEKIT_AUTOTUNE", AUTOTUNE_MODES, "cached")


def dependent_launch() -> bool:
    """TILEKIT_DEPENDENT_LAUNCH: 1 (default) launches kernels with programmatic dependent launch, 0 does not."""
    return choice("TILEKIT_DEPENDENT_LAUNCH", ("0", "1"), "1") == "1"


PEER_ALL_REDUCE_LIMIT = 1 << 24
PEER_ALL_REDUCE_DEFAULT = 1 << 20
PEER_ALL_REDUCE_ALIGN = 16


def peer_all_reduce_bytes() -> int:
    """TILEKIT_PEER_ALL_REDUCE_BYTES: tensor-parallel all-reduces of up to this many bytes go through peer memory
    (tilekit.kernels.peer_all_reduce) where the ranks share a host and their GPUs reach each other, larger ones
    through NCCL. Default 1048576 (decode's messages); 0: NCCL for all. At most 16 MiB (the inboxes take 2 x world
    size x this), a multiple of 16 (an inbox's slots lie this many bytes apart: each must start aligned for any
    dtype, which 1048577 would not)."""
    value = integer("TILEKIT_PEER_ALL_REDUCE_BYTES", 0, PEER_ALL_REDUCE_LIMIT)
    if value is not None and value % PEER_ALL_REDUCE_ALIGN:
        raise ValueError(f"TILEKIT_PEER_ALL_REDUCE_BYTES={quoted(os.environ['TILEKIT_PEER_ALL_REDUCE_BYTES'])} is not "
                         f"a multiple of {PEER_ALL_REDUCE_ALIGN} (the peer inboxes' slots lie this many bytes apart, "
                         "and each must start aligned for any dtype)")
    return PEER_ALL_REDUCE_DEFAULT if value is None else value


# The longest path the user tuning database writes below its directory: a writer's temporary file of a GPU's file
# (tuning/sm_NNN/.<name of up to autotune.db.MAX_NAME characters>.json.<16 hex digits>.tmp).
CACHE_DEEPEST = Path("tuning", "sm_" + "0" * 5, "." + "x" * 128 + ".json." + "0" * 16 + ".tmp")


def cache_dir() -> Path | None:
    """TILEKIT_CACHE_DIR: the user tuning database's directory, or None for the platform's default. A path that
    cannot even be looked at (a name too long, a permission denied on the way), or too long for the database's
    files below it, is an error naming the variable, not an OSError at every kernel's lookup or write; one not made
    yet, or with a file on the way, is not (the database reports the file when it writes)."""
    path = directory("TILEKIT_CACHE_DIR")
    for below in (Path(), CACHE_DEEPEST) if path is not None else ():
        try:
            (path / below).stat()
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            why = "too long for the tuning database's files in it" if below.parts and e.errno == errno.ENAMETOOLONG \
                else "cannot be read"
            raise ValueError(f"TILEKIT_CACHE_DIR={quoted(os.environ['TILEKIT_CACHE_DIR'])}: {why} "
                             f"({e.strerror})") from None
    return path


def shipped_dir() -> Path | None:
    """TILEKIT_SHIPPED_DB: a shipped tuning database to read instead of the packaged one (None: unset). It must
    be an existing directory, empty or holding architecture folders (sm_90, ...): a typo must not silently leave
    every kernel untuned."""
    path = directory("TILEKIT_SHIPPED_DB")
    try:
        problem = None if path is None or path.is_dir() else "not a directory" if path.exists() else \
            "no such directory"
        if problem is None and path is not None:
            names = [p.name for p in itertools.islice(path.iterdir(), 4096)]
            if names and not any(n.startswith("sm_") for n in names):
                problem = "not a tuning database (no sm_* architecture folder in it)"
    except OSError as e:    # a name too long, a permission denied on the way
        problem = f"cannot be read ({e.strerror})"
    if problem:
        raise ValueError(f"TILEKIT_SHIPPED_DB={quoted(os.environ['TILEKIT_SHIPPED_DB'])}: {problem} (unset it to "
                         "use the tuning database packaged with tilekit)")
    return path


def hub_cache_dir() -> tuple[Path, str]:
    """The Hugging Face hub cache, located as huggingface_hub locates it, and the variable that placed it."""
    for var, below in (("HF_HUB_CACHE", ()), ("HF_HOME", ("hub",))):
        path = directory(var)
        if path is not None:
            return path.joinpath(*below), var
    cache = directory("XDG_CACHE_HOME") or Path(expand_user("~/.cache", "XDG_CACHE_HOME or ~/.cache"))
    return cache / "huggingface" / "hub", "XDG_CACHE_HOME or ~/.cache"


def integer(name: str, low: int, high: int | None = None) -> int | None:
    """Variable `name` as an integer in [low, high] (None when unset or empty); ValueError naming it otherwise."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return None
    text = raw.strip()
    value = int(text) if text.isascii() and text.isdigit() and len(text) <= 20 else None   # not Python's digit limit
    if value is None or value < low or (high is not None and value > high):
        raise ValueError(f"{name}={quoted(raw)} is not an integer in [{low}, {'...' if high is None else high}]")
    return value


DISTRIBUTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Distributed:
    """This process's place among the ranks of one tensor-parallel model (torchrun's variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def distributed() -> Distributed | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, checked; None when none of them is set (one
    process). Set partly, or inconsistently (RANK >= WORLD_SIZE, ...), is a ValueError naming the variable."""
    if not any(os.environ.get(name, "").strip() for name in DISTRIBUTED):
        return None
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if not os.environ.get(name, "").strip()]
    if missing:
        raise ValueError(f"{', '.join(missing)} unset: a tensor-parallel rank needs RANK, WORLD_SIZE, MASTER_ADDR "
                         "and MASTER_PORT (as torchrun sets them), or none of them for one process")
    world = integer("WORLD_SIZE", 1, 1 << 16)
    rank = integer("RANK", 0)
    if rank >= world:
        raise ValueError(f"RANK={rank} is not below WORLD_SIZE={world}")
    local = integer("LOCAL_RANK", 0)
    local = rank if local is None else local
    if local > rank:
        raise ValueError(f"LOCAL_RANK={local} is above RANK={rank}")
    return Distributed(rank, world, local, host("MASTER_ADDR"), integer("MASTER_PORT", 1, 65535))


HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def host(name: str) -> str:
    """Variable `name` (blanks stripped) as a host to connect to: an IPv4 or IPv6 address (an IPv6 one may come in
    brackets, which are dropped), or a host name of at most 253 characters: dot-separated labels of 1 to 63 ASCII
    letters, digits, '_' and '-' (not at either end), the last not all digits, one final dot allowed. ValueError
    naming the variable otherwise: the resolver raises UnicodeError for a bad label, and waits out the rendezvous
    on a name such as 999.1.1.1."""
    raw = os.environ.get(name, "")
    text = raw.strip()
    if text.isascii() and all(c.isalnum() or c in ".-:[]_" for c in text):     # no scope id (%eth0), no blank
        bracketed = text.startswith("[") and text.endswith("]")
        try:
            if ipaddress.ip_address(text[1:-1] if bracketed else text).version == 6 or not bracketed:
                return text[1:-1] if bracketed else text
        except ValueError:
            labels = text.removesuffix(".").split(".")
            if len(".".join(labels)) <= 253 and all(map(HOST_LABEL.fullmatch, labels)) and not labels[-1].isdigit():
                return text
    raise ValueError(f"{name}={quoted(raw)} is not a host name or address")


def api_key() -> str | None:
    """TILEKIT_API_KEY: the bearer token `tilekit serve` requires (None: unset or empty). It must be 1 to 512
    printable ASCII characters, no blanks; a bad one is a ValueError naming the variable, never showing the value."""
    raw = os.environ.get("TILEKIT_API_KEY", "")
    if not raw:
        return None
    if len(raw) > 512 or not raw.isascii() or not raw.isprintable() or any(c.isspace() for c in raw):
        raise ValueError("TILEKIT_API_KEY must be 1 to 512 printable ASCII characters without blanks (its value is "
                         "not shown)")
    return raw


def check() -> None:
    """Read every variable above; the first bad one raises (ValueError or FileNotFoundError, naming it)."""
    autotune_mode()
    api_key()
    dependent_launch()
    peer_all_reduce_bytes()
    cache_dir()
    shipped_dir()
    hub_cache_dir()
    distributed()

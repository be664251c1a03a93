"""A checkpoint's files opened safely: regular files only (a FIFO or device is never opened), positional exact
reads, bounded whole reads, JSON objects, plain file names; ModelFileError, the error every bad model file is."""

from __future__ import annotations

import json
import os
import stat

from tilekit.untrusted import parse_json, shown

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_JSON_BYTES = 32 << 20   # a config.json, shard index or safetensors header; larger ones are refused unread


def json_shown(value) -> str:
    """A JSON value from a file as JSON text (escaped), cut after 100 characters."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 100 else text[:100] + "..."


class ModelFileError(ValueError):
    """A model file tilekit refuses; the message is the file, then the field and the problem."""

    def __init__(self, path, problem: str):
        super().__init__(f"{shown(path)}: {problem}")
        self.path, self.problem = path, problem

    def __reduce__(self):
        return type(self), (self.path, self.problem)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class TensorValueError(ValueError):
    """Raised by a load transform for values its tensor must not hold (the loader names the file and tensor)."""


class RegularFile:
    """An open regular file: checked with stat before opening (a FIFO or device is never opened) and with fstat
    after; reads are positional and exact. `path` is how messages name it, `real` where it resolves to."""

    def __init__(self, path, real: str | None = None):
        self.path = path
        real = os.path.realpath(path) if real is None else real
        try:
            st = os.stat(real)
            if not stat.S_ISREG(st.st_mode):
                kind = next((k for test, k in _KINDS if test(st.st_mode)), "a special file")
                raise ModelFileError(path, f"is not a regular file but {kind}")
            self.fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise _os_error(path, real, e) from None
        now = os.fstat(self.fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            self.close()
            raise ModelFileError(path, "changed while it was being opened")
        self.size, self.id = now.st_size, (now.st_dev, now.st_ino)

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fill `view` from byte `offset`; ModelFileError if the file ends first (it shrank) or a read fails."""
        done = 0
        try:
            while done < len(view):
                got = os.preadv(self.fd, [view[done:]], offset + done)
                if got == 0:
                    raise ModelFileError(self.path, f"ends at byte {offset + done}, before byte {offset + len(view)}"
                                                    " (it shrank after its header was read)")
                done += got
        except OSError as e:
            raise ModelFileError(self.path, f"cannot be read ({e.strerror})") from None

    def read(self, n: int, offset: int = 0) -> bytearray:
        buf = bytearray(n)
        self.readinto(memoryview(buf), offset)
        return buf

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "RegularFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _os_error(path, real: str, e: OSError) -> Exception:
    """An OSError met opening `path` as the error to raise, naming the file."""
    if isinstance(e, FileNotFoundError):
        if os.path.lexists(path):
            return FileNotFoundError(f"{shown(path)}: is a broken link (to {shown(real)}, which does not exist)")
        return FileNotFoundError(f"{shown(path)}: no such file")
    return ModelFileError(path, f"cannot be opened ({e.strerror})")


def read_whole(file: RegularFile, limit: int) -> bytearray:
    """An open file's bytes, read whole; ModelFileError, unread, if it is larger than `limit`."""
    if file.size > limit:
        raise ModelFileError(file.path, "is larger than " + (f"{limit >> 20} MiB" if limit % (1 << 20) == 0
                                                              else f"{limit} bytes"))
    return file.read(file.size)


def json_object(file: RegularFile) -> dict:
    """The JSON object in an open file, read whole (at most MAX_JSON_BYTES)."""
    try:
        d = parse_json(read_whole(file, MAX_JSON_BYTES))
    except ModelFileError:
        raise
    except ValueError as e:
        raise ModelFileError(file.path, str(e)) from None
    if not isinstance(d, dict):
        raise ModelFileError(file.path, f"holds {json_shown(d)}, expected a JSON object")
    return d


def read_json(path) -> dict:
    """The JSON object in the file `path` (any location: for files a user names; a checkpoint's files are read
    with Checkpoint.read_json)."""
    with RegularFile(path) as f:
        return json_object(f)


def is_inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def plain_name_problem(name) -> str | None:
    """Why `name` is not a plain file name (no directories, no control characters, at most 255 bytes), or None."""
    if not isinstance(name, str):
        return "is not a string"
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        return "is not a plain file name"
    if not name.isprintable():
        return "has control characters"
    if len(os.fsencode(name)) > 255:
        return "is longer than 255 bytes"
    return None

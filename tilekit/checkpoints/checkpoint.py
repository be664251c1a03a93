"""A checkpoint directory, and where to find one: a path, or a model name in the local Hugging Face hub cache (its
models--org--name/snapshots/<revision> layout, refs/main first). Files are opened by plain name only when they
resolve inside the directory (in a hub snapshot, also the repository's blobs). Never touches the network."""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from tilekit.checkpoints.fields import Fields
from tilekit.checkpoints.files import (CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, ModelFileError, RegularFile,
                                       is_inside, json_object, read_whole, plain_name_problem)
from tilekit.checkpoints.safetensors import TensorFiles
from tilekit.env import expand_user, hub_cache_dir
from tilekit.untrusted import quoted, shown

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?", re.ASCII)
_REVISION = re.compile(r"[0-9a-f]{4,64}")   # a snapshot's name: a commit hash


def _snapshot_roots(real_dir: str) -> tuple[str, ...]:
    """Where the files of directory `real_dir` may resolve to: itself, and for a hub snapshot
    (models--*/snapshots/<rev>) its repository's blobs, where huggingface_hub links them."""
    snapshots, repo = os.path.dirname(real_dir), os.path.dirname(os.path.dirname(real_dir))
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        return real_dir, os.path.join(repo, "blobs")
    return (real_dir,)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory whose files are opened by plain name, only when they are regular files resolving
    inside `roots` (the directory; for a hub snapshot also its repository's blobs)."""

    directory: Path
    roots: tuple[str, ...]

    @classmethod
    def at(cls, directory) -> "Checkpoint":
        """The checkpoint in `directory` (a Checkpoint is returned as it is)."""
        if isinstance(directory, Checkpoint):
            return directory
        directory = Path(os.path.abspath(directory))
        return cls(directory, _snapshot_roots(os.path.realpath(directory)))

    def has(self, name: str) -> bool:
        """Whether the directory has an entry `name` (a broken link counts: opening it says what is wrong)."""
        return os.path.lexists(self.directory / name)

    def open(self, name: str) -> RegularFile:
        problem = plain_name_problem(name)
        if problem:
            raise ValueError(f"file name {quoted(str(name))} {problem}")
        path = self.directory / name
        real = os.path.realpath(path)
        if not any(is_inside(real, root) for root in self.roots):
            raise ModelFileError(path, f"resolves to {shown(real)}, outside {' and '.join(map(shown, self.roots))}")
        return RegularFile(path, real)

    def read_json(self, name: str) -> dict:
        with self.open(name) as f:
            return json_object(f)

    def read_text(self, name: str, limit: int) -> str:
        """The UTF-8 text of file `name`, at most `limit` bytes."""
        with self.open(name) as f:
            raw = read_whole(f, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFileError(f.path, f"is not UTF-8 text ({e.reason} at byte {e.start})") from None

    def config(self) -> "Fields":
        """config.json, for typed reads of its fields."""
        return Fields(self.read_json(CONFIG_NAME), self.directory / CONFIG_NAME)

    def tensor_files(self) -> "TensorFiles":
        return TensorFiles(self)

    def check(self) -> None:
        """FileNotFoundError or ModelFileError unless config.json and the weights (model.safetensors, else the
        shard index) are regular files in the checkpoint."""
        self.open(CONFIG_NAME).close()
        name = WEIGHTS_NAME if self.has(WEIGHTS_NAME) or not self.has(INDEX_NAME) else INDEX_NAME
        if not self.has(name):
            raise FileNotFoundError(f"{shown(self.directory)}: lacks {WEIGHTS_NAME} or {INDEX_NAME}")
        self.open(name).close()


def find_checkpoint(path_or_name, orgs: tuple[str, ...] = ()) -> Checkpoint:
    """The checkpoint at `path_or_name`: a directory, else a hub model name in the local Hugging Face cache (a
    bare name also as org/name for each of `orgs`). It must hold config.json and model.safetensors or
    model.safetensors.index.json. Never touches the network. A Checkpoint is returned as it is."""
    if isinstance(path_or_name, Checkpoint):
        return path_or_name
    if not isinstance(path_or_name, (str, os.PathLike)) or not isinstance(os.fspath(path_or_name), str):
        raise TypeError(f"checkpoint must be a path or a model name, got {type(path_or_name).__name__}")
    text = os.fspath(path_or_name)
    if "\0" in text:
        raise ValueError(f"checkpoint path {quoted(text)} contains a NUL character")
    path = expand_user(text, "checkpoint path")
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise ValueError(f"checkpoint path {quoted(text)} ({len(text)} characters) is too long") from None
        raise ModelFileError(path, f"cannot be opened ({e.strerror})") from None
    if is_dir:
        checkpoint = Checkpoint.at(path)
        checkpoint.check()
        return checkpoint
    if is_dir is False:
        raise FileNotFoundError(f"{shown(path)}: is not a checkpoint directory")
    searched = [shown(os.path.abspath(path))]
    if _HUB_NAME.fullmatch(text):
        try:
            cache, var = hub_cache_dir()
        except FileNotFoundError as e:       # the variable names no usable directory: say which model was asked for
            raise FileNotFoundError(f"no checkpoint {quoted(text)}: the hub cache cannot be located: {e}") from None
        for repo_id in [text] + ([f"{org}/{text}" for org in orgs] if "/" not in text else []):
            found, tried = _cached_snapshot(cache / ("models--" + repo_id.replace("/", "--")))
            if found:
                return found
            searched += tried
        if not os.path.isdir(cache):
            searched.append(f"{shown(cache)}: no such directory (the hub cache, from {var})")
    raise FileNotFoundError(f"no checkpoint {quoted(text)}; searched: " + "; ".join(searched))


def _cached_snapshot(repo: Path) -> tuple[Checkpoint | None, list[str]]:
    """The snapshot of hub-cache repository `repo` that is a complete checkpoint, refs/main's revision first,
    then the newest; else None and, for each place searched, why it was not used."""
    snapshots = repo / "snapshots"
    try:
        entries = sorted(os.scandir(snapshots), key=lambda e: e.stat(follow_symlinks=False).st_mtime, reverse=True)
    except OSError:
        return None, [shown(snapshots)]
    revisions = [e.name for e in entries if _REVISION.fullmatch(e.name)]
    refs = Checkpoint(repo / "refs", (os.path.realpath(repo),))
    if refs.has("main"):
        with refs.open("main") as f:
            if f.size > 256:
                raise ModelFileError(f.path, f"is {f.size} bytes, too large for a revision")
            text = f.read(f.size).decode("utf-8", "replace").strip()
        if not _REVISION.fullmatch(text):
            raise ModelFileError(f.path, f"names revision {quoted(text)}, which is not a commit hash")
        revisions = [text] + [r for r in revisions if r != text]
    tried, within = [], os.path.realpath(snapshots)
    for revision in revisions:
        directory = snapshots / revision
        real = os.path.realpath(directory)
        try:
            if os.path.dirname(real) != within:
                raise ModelFileError(directory, f"resolves to {shown(real)}, outside {shown(snapshots)}")
            if not os.path.isdir(real):
                raise FileNotFoundError(f"{shown(directory)}: no such directory")
            checkpoint = Checkpoint.at(directory)
            checkpoint.check()
            return checkpoint, tried
        except (FileNotFoundError, ModelFileError) as e:
            tried.append(str(e))
    return None, tried or [f"{shown(snapshots)}: no snapshot"]

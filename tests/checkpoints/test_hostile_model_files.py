"""Hostile model files against tilekit.checkpoints, one class per kind of hostility in issue #31.

Each case states its outcome exactly: the exception's type and whole message (naming the file and the field,
control characters escaped), that the refusal allocated under a small bound (nothing large: tracemalloc's peak),
and that nothing under the test's directory changed. Special files must not block: a test stuck for 20 s fails.
"""

import json
import os
import socket
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests._numpy_cupy import numpy_cupy  # noqa: F401  (a fixture)
from tilekit.models import GPT, Llama, families
from tilekit import checkpoints as hf
from tilekit.engine.sampling import GenerationSettings
from tilekit.checkpoints import Checkpoint, ModelFileError, Target
from tilekit.engine.text import load_tokenizer

PLAN = {"w": Target((2, 3)), "n": Target((3,))}
DTYPE_LIST = "BF16, BOOL, F16, F32, F64, F8_E4M3, F8_E5M2, I16, I32, I64, I8, U16, U32, U64, U8"
GiB = 1 << 30


pytestmark = pytest.mark.usefixtures("no_hang")


def tree(root: Path) -> dict:
    """Every entry under root, not following links: link targets, kinds, sizes and (small files) bytes."""
    out = {}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(parent, name)
            st = os.lstat(p)
            out[p] = (os.readlink(p) if os.path.islink(p) else st.st_mode, st.st_size,
                      Path(p).read_bytes() if os.path.isfile(p) and not os.path.islink(p) and st.st_size < 1 << 20
                      else None)
    return out


def refused(root: Path, error: type, message: str, action, peak: int = 1 << 20) -> None:
    """action() raises exactly `error` with exactly `message` (printable but for line breaks), allocating under
    `peak` bytes, and nothing under `root` changes."""
    before = tree(root)
    tracemalloc.start()
    try:
        with pytest.raises(Exception) as info:
            action()
        top = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert type(info.value) is error, repr(info.value)
    assert str(info.value) == message
    assert all(c.isprintable() or c == "\n" for c in message), message
    assert top < peak, top
    assert tree(root) == before


def good(root: Path, name: str = "ck", shard_bytes=None) -> Path:
    """A small valid checkpoint, sharded as w | n when `shard_bytes` is given."""
    hf.write_checkpoint(root / name, {"model_type": "llama"},
                        {"w": np.ones((2, 3), np.float32), "n": np.ones(3, np.float32)}, shard_bytes=shard_bytes)
    return root / name


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SHARD_2 = "model-00002-of-00003.safetensors"     # of tests/data/tiny-llama


def find(path):
    return lambda: hf.find_checkpoint(path)


def headers(directory: Path):
    return lambda: Checkpoint.at(directory).tensor_files().close()


def loads(directory: Path, plan=PLAN):
    def action():
        with Checkpoint.at(directory).tensor_files() as files:
            hf.load_tensors(files, plan, device=hf.HostDevice())
    return action


def relink(path: Path, target) -> None:
    path.unlink()
    path.symlink_to(target)


def sparse(path: Path, size: int) -> Path:
    """`path` made `size` bytes long, its content kept: what it adds takes no disk."""
    path.touch()
    os.truncate(path, size)
    return path


def hub_repo(root: Path, monkeypatch, repo_id="org/m", revisions=("aaaa1111",)) -> Path:
    """A hub cache under root/hub (HF_HUB_CACHE) with one repository: snapshots whose files link into blobs."""
    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hub"))
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    for revision in revisions:
        source = good(root / "staging", revision)
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / revision).mkdir(parents=True)
        for f in source.iterdir():
            f.rename(repo / "blobs" / f"{revision}-{f.name}")
            (repo / "snapshots" / revision / f.name).symlink_to(Path("..", "..", "blobs", f"{revision}-{f.name}"))
    return repo


# -- paths and links outside the directory ------------------------------------------------------------------

class TestLinksOutTheDirectory:
    def test_config_linked_outside(self, tmp_path):
        d = good(tmp_path)
        (tmp_path / "outside.json").write_text("{}")
        relink(d / "config.json", tmp_path / "outside.json")
        refused(tmp_path, ModelFileError, f"{d}/config.json: resolves to {tmp_path}/outside.json, outside {d}", find(d))

    def test_weights_linked_outside_relatively(self, tmp_path):
        d = good(tmp_path)
        (d / "model.safetensors").rename(tmp_path / "w.safetensors")
        (d / "model.safetensors").symlink_to("../w.safetensors")
        refused(tmp_path, ModelFileError, f"{d}/model.safetensors: resolves to {tmp_path}/w.safetensors, outside {d}",
                find(d))

    def test_a_shard_linked_outside(self, tmp_path):
        d = good(tmp_path, shard_bytes=24)
        (d / SHARDS[1]).rename(tmp_path / SHARDS[1])
        (d / SHARDS[1]).symlink_to(tmp_path / SHARDS[1])
        refused(tmp_path, ModelFileError, f"{d}/{SHARDS[1]}: resolves to {tmp_path}/{SHARDS[1]}, outside {d}",
                headers(d))

    def test_a_link_loop(self, tmp_path):
        d = good(tmp_path)
        relink(d / "config.json", "loop.json")
        (d / "loop.json").symlink_to("config.json")
        refused(tmp_path, ModelFileError, f"{d}/config.json: cannot be opened (Too many levels of symbolic links)",
                find(d))

    def test_a_snapshot_linking_into_another_repositorys_blobs(self, tmp_path, monkeypatch):
        repo = hub_repo(tmp_path, monkeypatch)
        other = hub_repo(tmp_path, monkeypatch, "org/other", ("bbbb2222",))
        snap = repo / "snapshots" / "aaaa1111"
        relink(snap / "config.json", Path("..", "..", "..", other.name, "blobs", "bbbb2222-config.json"))
        monkeypatch.chdir(tmp_path)
        refused(tmp_path, FileNotFoundError,
                f"no checkpoint 'org/m'; searched: {tmp_path}/org/m; {snap}/config.json: resolves to "
                f"{other}/blobs/bbbb2222-config.json, outside {snap} and {repo}/blobs", find("org/m"))

    def test_a_snapshot_directory_linked_out_of_its_repository(self, tmp_path, monkeypatch):
        repo = hub_repo(tmp_path, monkeypatch)
        elsewhere = good(tmp_path, "elsewhere")
        (repo / "snapshots" / "cccc3333").symlink_to(elsewhere)
        monkeypatch.chdir(tmp_path)
        hf.find_checkpoint("org/m")             # the good snapshot still loads; the linked one is passed over
        (repo / "snapshots" / "aaaa1111" / "config.json").unlink()
        os.utime(repo / "snapshots" / "aaaa1111", (1, 1))   # the oldest: searched last
        refused(tmp_path, FileNotFoundError,
                f"no checkpoint 'org/m'; searched: {tmp_path}/org/m; {repo}/snapshots/cccc3333: resolves to "
                f"{elsewhere}, outside {repo}/snapshots; {repo}/snapshots/aaaa1111/config.json: no such file",
                find("org/m"))


# -- hub-cache refs/main naming a path -----------------------------------------------------------------------

class TestHubRefs:
    @pytest.mark.parametrize("ref", ["../../../etc", "/etc/passwd", "main", "", "abc", "ABCDEF12", "aaaa1111/..",
                                     "\x1b[2Jaaaa1111", "a" * 65, "x" * 200])
    def test_refs_main_naming_anything_but_a_commit_hash(self, tmp_path, monkeypatch, ref):
        repo = hub_repo(tmp_path, monkeypatch)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(ref + "\n")
        refused(tmp_path, ModelFileError,
                f"{repo}/refs/main: names revision {ref!r}, which is not a commit hash", find("org/m"))

    def test_a_huge_refs_main_is_refused_unread(self, tmp_path, monkeypatch):
        repo = hub_repo(tmp_path, monkeypatch)
        (repo / "refs").mkdir()
        sparse(repo / "refs" / "main", GiB)
        refused(tmp_path, ModelFileError, f"{repo}/refs/main: is 1073741824 bytes, too large for a revision",
                find("org/m"))

    def test_refs_main_a_fifo_or_a_link_out(self, tmp_path, monkeypatch):
        repo = hub_repo(tmp_path, monkeypatch)
        (repo / "refs").mkdir()
        os.mkfifo(repo / "refs" / "main")
        refused(tmp_path, ModelFileError, f"{repo}/refs/main: is not a regular file but a FIFO", find("org/m"))
        (tmp_path / "secret").write_text("aaaa1111")
        relink(repo / "refs" / "main", tmp_path / "secret")
        refused(tmp_path, ModelFileError, f"{repo}/refs/main: resolves to {tmp_path}/secret, outside {repo}",
                find("org/m"))

    def test_refs_main_naming_an_absent_snapshot_falls_back(self, tmp_path, monkeypatch):
        repo = hub_repo(tmp_path, monkeypatch)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("dddd4444")
        assert hf.find_checkpoint("org/m").directory == repo / "snapshots" / "aaaa1111"


# -- dangling snapshot links --------------------------------------------------------------------------------

class TestDanglingLinks:
    def test_a_snapshot_whose_blob_is_missing(self, tmp_path, monkeypatch):
        repo = hub_repo(tmp_path, monkeypatch)
        (repo / "blobs" / "aaaa1111-config.json").unlink()
        snap = repo / "snapshots" / "aaaa1111"
        monkeypatch.chdir(tmp_path)
        refused(tmp_path, FileNotFoundError,
                f"no checkpoint 'm'; searched: {tmp_path}/m; {tmp_path}/hub/models--m/snapshots; {snap}/config.json: "
                f"is a broken link (to {repo}/blobs/aaaa1111-config.json, which does not exist)",
                lambda: hf.find_checkpoint("m", orgs=("org",)))

    def test_a_dangling_weights_link_in_a_directory(self, tmp_path):
        d = good(tmp_path)
        relink(d / "model.safetensors", "gone.safetensors")
        refused(tmp_path, FileNotFoundError,
                f"{d}/model.safetensors: is a broken link (to {d}/gone.safetensors, which does not exist)", find(d))

    def test_a_dangling_shard(self, tmp_path):
        d = good(tmp_path, shard_bytes=24)
        relink(d / SHARDS[0], "gone")
        refused(tmp_path, FileNotFoundError, f"{d}/{SHARDS[0]}: is a broken link (to {d}/gone, which does not exist)",
                headers(d))


# -- ~user and very long names ------------------------------------------------------------------------------

class TestUserAndLongNames:
    def test_an_unknown_user(self, tmp_path, monkeypatch):
        refused(tmp_path, FileNotFoundError, "checkpoint path '~nosuchuser_tilekit/m': no user 'nosuchuser_tilekit'",
                find("~nosuchuser_tilekit/m"))
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.setenv("HF_HOME", "~nosuchuser_tilekit")
        monkeypatch.chdir(tmp_path)
        refused(tmp_path, FileNotFoundError, "no checkpoint 'org/m': the hub cache cannot be located: "
                                             "HF_HOME '~nosuchuser_tilekit': no user 'nosuchuser_tilekit'", find("org/m"))
        monkeypatch.setenv("HF_HUB_CACHE", "~nosuchuser/hub")      # the variable and the model asked for, both named
        refused(tmp_path, FileNotFoundError, "no checkpoint 'org/m': the hub cache cannot be located: "
                                             "HF_HUB_CACHE '~nosuchuser/hub': no user 'nosuchuser'", find("org/m"))

    @pytest.mark.parametrize("make", [lambda tmp: "x" * 5000, lambda tmp: f"{tmp}/{'a' * 300}/ck"])
    def test_a_name_too_long(self, tmp_path, make):
        text = make(tmp_path)
        refused(tmp_path, ValueError, f"checkpoint path {text[:200]!r}... ({len(text)} characters) is too long",
                find(text))

    def test_a_nul_a_bytes_path_and_a_hub_name_too_long(self, tmp_path, monkeypatch):
        refused(tmp_path, ValueError, "checkpoint path 'a\\x00b' contains a NUL character", find("a\0b"))
        refused(tmp_path, TypeError, "checkpoint must be a path or a model name, got bytes", find(b"ck"))
        monkeypatch.chdir(tmp_path)
        name = "org/" + "m" * 97                        # longer than a hub name may be: not looked up
        refused(tmp_path, FileNotFoundError, f"no checkpoint {name!r}; searched: {tmp_path}/{name}", find(name))


# -- FIFOs and special files --------------------------------------------------------------------------------

class TestSpecialFiles:
    @pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
    def test_a_fifo_is_never_opened(self, tmp_path, name):
        d = good(tmp_path)
        (d / name).unlink()
        os.mkfifo(d / name)
        refused(tmp_path, ModelFileError, f"{d}/{name}: is not a regular file but a FIFO", find(d))

    def test_a_fifo_index_and_shard(self, tmp_path):
        d = good(tmp_path, shard_bytes=24)
        (d / SHARDS[1]).unlink()
        os.mkfifo(d / SHARDS[1])
        refused(tmp_path, ModelFileError, f"{d}/{SHARDS[1]}: is not a regular file but a FIFO", headers(d))
        (d / hf.INDEX_NAME).unlink()
        os.mkfifo(d / hf.INDEX_NAME)
        refused(tmp_path, ModelFileError, f"{d}/{hf.INDEX_NAME}: is not a regular file but a FIFO", find(d))

    def test_a_socket_and_a_directory(self, tmp_path, monkeypatch):
        d = good(tmp_path)
        (d / "config.json").unlink()
        monkeypatch.chdir(d)                            # a short path: socket names are limited to 108 bytes
        with socket.socket(socket.AF_UNIX) as s:
            s.bind("config.json")
            refused(tmp_path, ModelFileError, f"{d}/config.json: is not a regular file but a socket", find(d))
        (d / "config.json").unlink()
        (d / "config.json").mkdir()
        refused(tmp_path, ModelFileError, f"{d}/config.json: is not a regular file but a directory", find(d))

    def test_dev_zero_as_weights_or_blob(self, tmp_path, monkeypatch):
        d = good(tmp_path)
        relink(d / "model.safetensors", "/dev/zero")
        refused(tmp_path, ModelFileError, f"{d}/model.safetensors: resolves to /dev/zero, outside {d}", find(d))
        repo = hub_repo(tmp_path, monkeypatch)
        relink(repo / "blobs" / "aaaa1111-model.safetensors", "/dev/zero")
        snap = repo / "snapshots" / "aaaa1111"
        refused(tmp_path, ModelFileError, f"{snap}/model.safetensors: resolves to /dev/zero, outside {snap} and "
                                          f"{repo}/blobs", headers(snap))

    def test_a_named_file_that_is_a_device_or_fifo(self, tmp_path):
        refused(tmp_path, ModelFileError, "/dev/zero: is not a regular file but a character device",
                lambda: hf.read_json("/dev/zero"))
        os.mkfifo(tmp_path / "fifo.json")
        refused(tmp_path, ModelFileError, f"{tmp_path}/fifo.json: is not a regular file but a FIFO",
                lambda: hf.read_json(tmp_path / "fifo.json"))


# -- huge sparse files --------------------------------------------------------------------------------------

class TestHugeSparseFiles:
    def test_a_huge_config_or_index_is_refused_unread(self, tmp_path):
        d = good(tmp_path, shard_bytes=24)
        sparse(d / "config.json", 64 << 20)
        refused(tmp_path, ModelFileError, f"{d}/config.json: is larger than 32 MiB", lambda: Checkpoint.at(d).config())
        sparse(d / hf.INDEX_NAME, 4 * GiB)
        refused(tmp_path, ModelFileError, f"{d}/{hf.INDEX_NAME}: is larger than 32 MiB", headers(d))

    def test_a_header_length_beyond_the_cap_or_the_file(self, tmp_path):
        d = good(tmp_path)
        w = d / "model.safetensors"
        w.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
        sparse(w, 8192)
        refused(tmp_path, ModelFileError, f"{w}: declares a 1099511627776-byte header, larger than 32 MiB", headers(d))
        w.write_bytes((1 << 20).to_bytes(8, "little") + b"{}" + b" " * 90)
        refused(tmp_path, ModelFileError, f"{w}: declares a 1048576-byte header but is 100 bytes", headers(d))

    def test_gigabytes_declared_by_an_8_kb_file_are_never_read(self, tmp_path):
        """A 4 GiB sparse file whose header is consistent: refused on the header's shape, data untouched."""
        d = good(tmp_path)
        w = d / "model.safetensors"
        header = json.dumps({"w": {"dtype": "F32", "shape": [GiB], "data_offsets": [0, 4 * GiB]}}).encode()
        w.write_bytes(len(header).to_bytes(8, "little") + header)
        sparse(w, 8 + len(header) + 4 * GiB)
        assert os.stat(w).st_blocks * 512 <= 64 << 10
        refused(tmp_path, ModelFileError, f"{w}: does not match the model:\n  tensor 'w' has shape (1073741824,), "
                                          "expected (2, 3)\n  missing tensor 'n' (shape (3,))", loads(d))

    def test_gigabytes_declared_but_not_there(self, tmp_path):
        d = good(tmp_path)
        w = d / "model.safetensors"
        header = json.dumps({"w": {"dtype": "F32", "shape": [GiB], "data_offsets": [0, 4 * GiB]}}).encode()
        w.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8104))
        refused(tmp_path, ModelFileError, f"{w}: tensor 'w': data_offsets is [0, 4294967296], expected [begin, end] "
                                          "with 0 <= begin <= end <= 8104, the size of the data", headers(d))


# -- malformed safetensors headers --------------------------------------------------------------------------

def entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


def header_bytes(header) -> bytes:
    return header if isinstance(header, bytes) else json.dumps(header).encode()


SHAPE = "expected a list of at most 8 non-negative integers"
OFFSETS = "expected [begin, end] with 0 <= begin <= end <= 8, the size of the data"
ENTRY = "expected an object with exactly dtype, shape and data_offsets"
MALFORMED = [   # (file bytes, or (header, data bytes)) -> the problem after the file's name
    (b"", "is 0 bytes, too short for a safetensors file"),
    (b"\x05\0\0", "is 3 bytes, too short for a safetensors file"),
    ((b"\xff\xfe{}", b""), "header is not valid JSON (not UTF-8: invalid start byte at byte 0)"),
    ((b"{", b""), "header is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ((b'{"w": NaN}', b""), "header is not strict JSON (NaN is not a JSON number)"),
    ((b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 1e400]}}', b""),
     "header is not strict JSON (1e400 is out of range)"),
    ((b'{"w": {"dtype": "F32", "shape": [1' + b"0" * 5000 + b'], "data_offsets": [0, 8]}}', b""),
     "header is not strict JSON (Exceeds the limit (4300 digits) for integer string conversion)"),
    ((b'{"w": {}, "w": {}}', b""), "header is not strict JSON (repeated key 'w')"),
    ((b"[" * 100000 + b"]" * 100000, b""), "header is not valid JSON (nested too deeply)"),
    (([], b""), "header is [], expected a JSON object"),
    (("w", b""), 'header is "w", expected a JSON object'),
    (({"__metadata__": [], "w": entry()}, bytes(8)),
     "header field '__metadata__' is [], expected an object of strings"),
    (({"__metadata__": {"format": 1}}, b""),
     'header field \'__metadata__\' is {"format": 1}, expected an object of strings'),
    (({"w": 1}, b""), f"tensor 'w' is 1, {ENTRY}"),
    (({"w": {"dtype": "F32", "shape": [2]}}, b""), f'tensor \'w\' is {{"dtype": "F32", "shape": [2]}}, {ENTRY}'),
    (({"w": dict(entry(), extra=1)}, bytes(8)),
     f'tensor \'w\' is {{"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": 1}}, {ENTRY}'),
    (({"w": entry(dtype="F4")}, bytes(8)), f'tensor \'w\': dtype is "F4", expected one of {DTYPE_LIST}'),
    (({"w": entry(dtype="F8_E8M0")}, bytes(8)), f'tensor \'w\': dtype is "F8_E8M0", expected one of {DTYPE_LIST}'),
    (({"w": entry(dtype=["F32"])}, bytes(8)), f'tensor \'w\': dtype is ["F32"], expected one of {DTYPE_LIST}'),
    (({"w": entry(shape=[-2])}, bytes(8)), f"tensor 'w': shape is [-2], {SHAPE}"),
    (({"w": entry(shape=[2.0])}, bytes(8)), f"tensor 'w': shape is [2.0], {SHAPE}"),
    (({"w": entry(shape=[True, 2])}, bytes(8)), f"tensor 'w': shape is [true, 2], {SHAPE}"),
    (({"w": entry(shape="2")}, bytes(8)), f'tensor \'w\': shape is "2", {SHAPE}'),
    (({"w": entry(shape=[1] * 9 + [2])}, bytes(8)), f"tensor 'w': shape is [1, 1, 1, 1, 1, 1, 1, 1, 1, 2], {SHAPE}"),
    (({"w": entry(offsets=(8, 0))}, bytes(8)), f"tensor 'w': data_offsets is [8, 0], {OFFSETS}"),
    (({"w": entry(offsets=(0, 9))}, bytes(8)), f"tensor 'w': data_offsets is [0, 9], {OFFSETS}"),
    (({"w": entry(offsets=(-1, 7))}, bytes(8)), f"tensor 'w': data_offsets is [-1, 7], {OFFSETS}"),
    (({"w": entry(offsets=[0])}, bytes(8)), f"tensor 'w': data_offsets is [0], {OFFSETS}"),
    (({"w": entry(offsets=[0.0, 8])}, bytes(8)), f"tensor 'w': data_offsets is [0.0, 8], {OFFSETS}"),
    (({"w": entry(shape=(3,))}, bytes(8)), "tensor 'w': data_offsets [0, 8] hold 8 bytes, but F32 (3,) takes 12"),
    (({"w": entry(), "v": entry(offsets=(4, 12))}, bytes(12)),
     "tensor 'v': data_offsets [4, 12] overlaps the tensor before it"),
    (({"w": entry(), "v": entry(offsets=(12, 20))}, bytes(20)),
     "tensor 'v': data_offsets [12, 20] leaves bytes [8, 12) of the data unused"),
    (({"w": entry()}, bytes(12)), "tensors end at byte 8 of the data, but the file holds 12 bytes of data"),
    (({}, bytes(3)), "tensors end at byte 0 of the data, but the file holds 3 bytes of data"),
]


class TestMalformedHeaders:
    @pytest.mark.parametrize("content, problem", MALFORMED)
    def test_every_malformation_is_named(self, tmp_path, content, problem):
        d = good(tmp_path)
        w = d / "model.safetensors"
        if isinstance(content, bytes):
            w.write_bytes(content)
        else:
            raw = header_bytes(content[0])
            w.write_bytes(len(raw).to_bytes(8, "little") + raw + content[1])
        refused(tmp_path, ModelFileError, f"{w}: {problem}", headers(d))


# -- FP8 tensors --------------------------------------------------------------------------------------------

class TestFP8:
    def test_fp8_where_a_float_is_expected_is_a_clean_refusal(self, tmp_path):
        d = good(tmp_path)
        w = d / "model.safetensors"
        raw = json.dumps({"w": entry("F8_E4M3", (2, 3), (0, 6)), "n": entry("F8_E5M2", (3,), (6, 9))}).encode()
        w.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(9))
        refused(tmp_path, ModelFileError, f"{w}: does not match the model:\n  tensor 'w' has dtype F8_E4M3, expected "
                                          "BF16 or F16 or F32\n  tensor 'n' has dtype F8_E5M2, expected BF16 or F16 or "
                                          "F32", loads(d))


class TestNonFiniteValues:
    @pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
    def test_a_weight_holding_an_inf_or_nan_is_named(self, tmp_path, value):
        w = np.ones((2, 3), np.float32)
        w[1, 2] = value
        hf.write_checkpoint(tmp_path / "ck", {"model_type": "llama"}, {"w": w, "n": np.ones(3, np.float32)})
        refused(tmp_path, ModelFileError, f"{tmp_path}/ck/model.safetensors: tensor 'w' holds a value that is not "
                                          "finite", loads(tmp_path / "ck", {"w": Target((2, 3), "float32"),
                                                                             "n": Target((3,), "float32")}))

    def test_a_value_that_overflows_the_models_dtype(self, tmp_path):
        """1e5 is a float32 but no float16: the conversion would make it an infinity."""
        hf.write_checkpoint(tmp_path / "ck", {"model_type": "llama"},
                            {"w": np.full((2, 3), 1e5, np.float32), "n": np.ones(3, np.float32)})
        refused(tmp_path, ModelFileError, f"{tmp_path}/ck/model.safetensors: tensor 'w' holds a value too large for "
                                          "float16", loads(tmp_path / "ck", {"w": Target((2, 3), "float16"),
                                                                              "n": Target((3,), "float16")}))


# -- shard indexes ------------------------------------------------------------------------------------------

class TestShardIndexes:
    @staticmethod
    def write_index(d: Path, weight_map) -> Path:
        (d / hf.INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 20}, "weight_map": weight_map}))
        return d / hf.INDEX_NAME

    @pytest.mark.parametrize("shard, problem", [
        ("../outside.safetensors", "is not a plain file name"), ("/etc/passwd", "is not a plain file name"),
        ("sub/x.safetensors", "is not a plain file name"), ("", "is not a plain file name"),
        (".", "is not a plain file name"), ("..", "is not a plain file name"), ("a\\b", "is not a plain file name"),
        ("nul\0.safetensors", "has control characters"), ("\x1b[2J.safetensors", "has control characters"),
        ("x" * 300, "is longer than 255 bytes"), (7, "is not a string"), (None, "is not a string")])
    def test_the_index_names_anything_but_a_plain_file_name(self, tmp_path, shard, problem):
        d = good(tmp_path, shard_bytes=24)
        index = self.write_index(d, {"w": SHARDS[0], "n": shard})
        shown = json.dumps(shard)
        shown = shown if len(shown) <= 100 else shown[:100] + "..."
        refused(tmp_path, ModelFileError, f"{index}: field 'weight_map' maps 'n' to {shown}, which {problem}",
                headers(d))

    @pytest.mark.parametrize("link", [os.symlink, os.link])
    def test_the_index_names_one_file_twice(self, tmp_path, link):
        d = good(tmp_path, shard_bytes=24)
        link(d / SHARDS[0], d / "alias.safetensors")
        index = self.write_index(d, {"w": SHARDS[0], "n": "alias.safetensors"})
        refused(tmp_path, ModelFileError, f"{index}: names one file twice: 'alias.safetensors' and '{SHARDS[0]}'",
                headers(d))

    def test_a_tensor_mapped_to_the_wrong_shard(self, tmp_path):
        d = good(tmp_path, shard_bytes=24)
        self.write_index(d, {"w": SHARDS[1], "n": SHARDS[0]})
        refused(tmp_path, ModelFileError,
                f"{d}/{SHARDS[0]}: does not match {hf.INDEX_NAME}: it holds tensors the index maps elsewhere or not at "
                "all 'w'; it lacks tensors the index maps to it 'n'", headers(d))

    def test_a_tensor_in_two_shards_or_unlisted(self, tmp_path):
        d = good(tmp_path, shard_bytes=24)
        save_file({"n": np.ones(3, np.float32), "w": np.ones((2, 3), np.float32)}, d / SHARDS[1])
        refused(tmp_path, ModelFileError, f"{d}/{SHARDS[1]}: does not match {hf.INDEX_NAME}: it holds tensors the "
                                          "index maps elsewhere or not at all 'w'", headers(d))

    @pytest.mark.parametrize("index, problem", [
        ({"weight_map": {}}, "field 'weight_map' is {}, expected a map of tensor names to shard files"),
        ({"weight_map": []}, "field 'weight_map' is [], expected a JSON object"),
        ({"metadata": {}}, "field 'weight_map' is missing, expected a JSON object"),
        ([], "holds [], expected a JSON object")])
    def test_a_malformed_index(self, tmp_path, index, problem):
        d = good(tmp_path, shard_bytes=24)
        (d / hf.INDEX_NAME).write_text(json.dumps(index))
        refused(tmp_path, ModelFileError, f"{d}/{hf.INDEX_NAME}: {problem}", headers(d))

    def test_an_absent_shard_or_a_directory(self, tmp_path):
        d = good(tmp_path, shard_bytes=24)
        self.write_index(d, {"w": SHARDS[0], "n": "absent.safetensors"})
        refused(tmp_path, FileNotFoundError, f"{d}/absent.safetensors: no such file", headers(d))
        (d / "sub").mkdir()
        self.write_index(d, {"w": SHARDS[0], "n": "sub"})
        refused(tmp_path, ModelFileError, f"{d}/sub: is not a regular file but a directory", headers(d))


# -- config field types and ranges --------------------------------------------------------------------------

def layers(f):
    return f.integer("num_hidden_layers", low=1, high=4096)


def eps(f):
    return f.number("rms_norm_eps", 1e-6, positive=True)


def eos(f):
    return f.token_ids("eos_token_id", vocab=100)


def tied(f):
    return f.boolean("tie_word_embeddings", False)


CONFIGS = [   # config.json text, a read, the problem after the file's name
    ('{"num_hidden_layers": 2.7}', layers, "field 'num_hidden_layers' is 2.7, expected an integer in [1, 4096]"),
    ('{"num_hidden_layers": true}', layers, "field 'num_hidden_layers' is true, expected an integer in [1, 4096]"),
    ('{"num_hidden_layers": 2.0}', layers, "field 'num_hidden_layers' is 2.0, expected an integer in [1, 4096]"),
    ('{"num_hidden_layers": "2"}', layers, "field 'num_hidden_layers' is \"2\", expected an integer in [1, 4096]"),
    ('{"num_hidden_layers": 0}', layers, "field 'num_hidden_layers' is 0, expected an integer in [1, 4096]"),
    ('{"num_hidden_layers": 1000000000000000000000}', layers,
     "field 'num_hidden_layers' is 1000000000000000000000, expected an integer in [1, 4096]"),
    ('{"num_hidden_layers": null}', layers, "field 'num_hidden_layers' is null, expected an integer in [1, 4096]"),
    ("{}", layers, "field 'num_hidden_layers' is missing, expected an integer in [1, 4096]"),
    ('{"rms_norm_eps": 0}', eps, "field 'rms_norm_eps' is 0, expected a finite number > 0"),
    ('{"rms_norm_eps": -1e-5}', eps, "field 'rms_norm_eps' is -1e-05, expected a finite number > 0"),
    ('{"rms_norm_eps": "1e-5"}', eps, "field 'rms_norm_eps' is \"1e-5\", expected a finite number > 0"),
    ('{"rms_norm_eps": null}', eps, "field 'rms_norm_eps' is null, expected a finite number > 0"),
    ('{"rms_norm_eps": 1' + "0" * 400 + "}", eps, "field 'rms_norm_eps' is 1" + "0" * 99 + "..., expected a finite "
                                                   "number > 0"),
    ('{"rms_norm_eps": 1e400}', eps, "not strict JSON (1e400 is out of range)"),
    ('{"rms_norm_eps": Infinity}', eps, "not strict JSON (Infinity is not a JSON number)"),
    ('{"rms_norm_eps": NaN}', eps, "not strict JSON (NaN is not a JSON number)"),
    ('{"rope_theta": 5e-324}', lambda f: f.number("rope_theta", 1e4, low=1.0),
     "field 'rope_theta' is 5e-324, expected a finite number >= 1.0"),
    ('{"rope_scaling": []}', lambda f: f.object("rope_scaling", None),
     "field 'rope_scaling' is [], expected a JSON object"),
    ('{"rope_scaling": "llama3"}', lambda f: f.object("rope_scaling", None),
     "field 'rope_scaling' is \"llama3\", expected a JSON object"),
    ('{"rope_scaling": {"factor": "8"}}', lambda f: f.object("rope_scaling").number("factor", positive=True),
     "field 'rope_scaling.factor' is \"8\", expected a finite number > 0"),
    ('{"eos_token_id": []}', eos, "field 'eos_token_id' is [], expected a token id or a non-empty list of them "
                                  "(integers in [0, 100))"),
    ('{"eos_token_id": [1, true]}', eos, "field 'eos_token_id' is [1, true], expected a token id or a non-empty list "
                                         "of them (integers in [0, 100))"),
    ('{"eos_token_id": 100}', eos, "field 'eos_token_id' is 100, expected a token id or a non-empty list of them "
                                   "(integers in [0, 100))"),
    ('{"eos_token_id": -1}', lambda f: f.token_ids("eos_token_id"), "field 'eos_token_id' is -1, expected a token id "
                                                                    "or a non-empty list of them (integers >= 0)"),
    ('{"eos_token_id": [[1]]}', eos, "field 'eos_token_id' is [[1]], expected a token id or a non-empty list of them "
                                     "(integers in [0, 100))"),
    ('{"tie_word_embeddings": 1}', tied, "field 'tie_word_embeddings' is 1, expected true or false"),
    ('{"tie_word_embeddings": null}', tied, "field 'tie_word_embeddings' is null, expected true or false"),
    ('{"model_type": "gpt_bigcode"}', lambda f: f.choice("model_type", ("llama",)),
     "field 'model_type' is \"gpt_bigcode\", expected one of \"llama\""),
    ('{"a": 1, "a": 2}', layers, "not strict JSON (repeated key 'a')"),
    ("[1]", layers, "holds [1], expected a JSON object"),
    ('{"x": 1', layers, "not valid JSON (Expecting ',' delimiter at line 1 column 8)"),
    ('\ufeff{}', layers, "not valid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) at line 1 column 1)"),
    ("[" * 100000 + "]" * 100000, layers, "not valid JSON (nested too deeply)"),
]


class TestConfigFields:
    @pytest.mark.parametrize("text, read, problem", CONFIGS)
    def test_every_field_is_type_and_range_checked(self, tmp_path, text, read, problem):
        d = good(tmp_path)
        (d / "config.json").write_text(text)
        refused(tmp_path, ModelFileError, f"{d}/config.json: {problem}", lambda: read(Checkpoint.at(d).config()))


# -- control characters in names and values -----------------------------------------------------------------

class TestControlCharacters:
    def test_in_a_tensor_name(self, tmp_path):
        d = good(tmp_path)
        w = d / "model.safetensors"
        save_file({"\x1b[2J\nFAKE": np.ones(1, np.float32), "w": np.ones((2, 3), np.float32),
                   "n": np.ones(3, np.float32)}, w)
        refused(tmp_path, ModelFileError, f"{w}: does not match the model:\n  unexpected tensor '\\x1b[2J\\nFAKE'",
                loads(d))
        raw = json.dumps({"\x07\u202e": entry(dtype="F9")}).encode()
        w.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(8))
        refused(tmp_path, ModelFileError, f"{w}: tensor '\\x07\\u202e': dtype is \"F9\", expected one of {DTYPE_LIST}",
                headers(d))

    def test_in_a_config_value(self, tmp_path):
        d = good(tmp_path)
        (d / "config.json").write_text(json.dumps({"model_type": "\x1b]0;owned\x07\n"}))
        refused(tmp_path, ModelFileError, f"{d}/config.json: field 'model_type' is \"\\u001b]0;owned\\u0007\\n\", "
                                          "expected one of \"llama\"",
                lambda: Checkpoint.at(d).config().choice("model_type", ("llama",)))

    def test_in_the_checkpoints_own_path_and_name(self, tmp_path, monkeypatch):
        d = good(tmp_path, "ck\x1b[31m\n")
        (d / "config.json").unlink()
        os.mkfifo(d / "config.json")
        refused(tmp_path, ModelFileError, f"{tmp_path}/ck\\x1b[31m\\n/config.json: is not a regular file but a FIFO",
                find(d))
        monkeypatch.chdir(tmp_path)
        refused(tmp_path, FileNotFoundError, f"no checkpoint 'gpt2\\r'; searched: {tmp_path}/gpt2\\r", find("gpt2\r"))


# -- every class again, end to end: from_pretrained, load_model, config_from_path, generation config, tokenizer --

DATA = Path(__file__).resolve().parents[1] / "data"


def tiny(root: Path, name: str) -> Path:
    """A copy of a tests/data fixture (regular files, so that they may be made hostile)."""
    d = root / name
    d.mkdir()
    for f in (DATA / name).iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


def load(path, cls=None):
    return lambda: (families.load_model(path, dtype="float32") if cls is None else
                    cls.from_pretrained(path, dtype="float32"))


DS_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}


@pytest.mark.usefixtures("numpy_cupy")
class TestThroughTheModels:
    @pytest.fixture(autouse=True)
    def imported(self):
        """Every family's modules imported before a test measures what a refusal allocates."""
        for family in families.FAMILIES.values():
            assert family.model_class and family.hub_orgs is not None

    def test_links_out_of_the_directory(self, tmp_path):
        d = tiny(tmp_path, "tiny-llama")
        (d / SHARD_2).rename(tmp_path / SHARD_2)
        (d / SHARD_2).symlink_to(tmp_path / SHARD_2)
        refused(tmp_path, ModelFileError, f"{d}/{SHARD_2}: resolves to {tmp_path}/{SHARD_2}, outside {d}", load(d))
        g = tiny(tmp_path, "tiny-gpt2")
        (g / "tokenizer.json").rename(tmp_path / "tokenizer.json")
        (g / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
        refused(tmp_path, ModelFileError, f"{g}/tokenizer.json: resolves to {tmp_path}/tokenizer.json, outside {g}",
                lambda: load_tokenizer(g))

    def test_hub_refs_main_naming_a_path(self, tmp_path, monkeypatch):
        repo = hub_repo(tmp_path, monkeypatch, "meta-llama/m")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("../../../etc")
        refused(tmp_path, ModelFileError, f"{repo}/refs/main: names revision '../../../etc', which is not a commit "
                                          "hash", load("m"))

    def test_a_dangling_shard(self, tmp_path):
        d = tiny(tmp_path, "tiny-llama")
        relink(d / SHARD_2, "gone")
        refused(tmp_path, FileNotFoundError, f"{d}/{SHARD_2}: is a broken link (to {d}/gone, which does not exist)",
                load(d, Llama))

    def test_user_and_long_names(self, tmp_path):
        refused(tmp_path, FileNotFoundError, "checkpoint path '~nosuchuser_tilekit/m': no user 'nosuchuser_tilekit'",
                load("~nosuchuser_tilekit/m"))
        refused(tmp_path, FileNotFoundError, "config path '~nosuchuser_tilekit/config.json': no user "
                                             "'nosuchuser_tilekit'",
                lambda: families.config_from_path("~nosuchuser_tilekit/config.json"))
        name = f"{tmp_path}/{'a' * 300}/ck"
        refused(tmp_path, ValueError, f"checkpoint path {name[:200]!r}... ({len(name)} characters) is too long",
                load(name, GPT))

    @pytest.mark.parametrize("name", ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json"])
    def test_a_fifo_is_never_opened(self, tmp_path, name):
        d = tiny(tmp_path, "tiny-gpt2")
        (d / name).unlink()
        os.mkfifo(d / name)
        action = {"generation_config.json": lambda: GenerationSettings.from_generation_config(d),
                  "tokenizer.json": lambda: load_tokenizer(d)}.get(name, load(d))
        refused(tmp_path, ModelFileError, f"{d}/{name}: is not a regular file but a FIFO", action)

    def test_gigabytes_declared_by_a_sparse_file_are_never_read(self, tmp_path):
        d = tiny(tmp_path, "tiny-llama-tied")
        w = d / "model.safetensors"
        header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [GiB, 2],
                                                           "data_offsets": [0, 4 * GiB]}}).encode()
        w.write_bytes(len(header).to_bytes(8, "little") + header)
        sparse(w, 8 + len(header) + 4 * GiB)
        with pytest.raises(ModelFileError) as info:
            load(d)()
        assert str(info.value).startswith(f"{w}: does not match LlamaConfig(")
        assert "\n  tensor 'model.embed_tokens.weight' has shape (1073741824, 2), expected (259, 64)\n" in \
            str(info.value)

    def test_malformed_header_and_fp8(self, tmp_path):
        d = tiny(tmp_path, "tiny-gpt2")
        w = d / "model.safetensors"
        w.write_bytes((10 ** 6).to_bytes(8, "little") + b"{}")
        refused(tmp_path, ModelFileError, f"{w}: declares a 1000000-byte header but is 10 bytes", load(d))
        raw = json.dumps({"wte.weight": entry("F8_E4M3", (1031, 64), (0, 1031 * 64))}).encode()
        w.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(1031 * 64))
        with pytest.raises(ModelFileError) as info:
            load(d, GPT)()
        assert "\n  tensor 'wte.weight' has dtype F8_E4M3, expected BF16 or F16 or F32\n" in str(info.value)

    def test_a_nan_weight(self, tmp_path):
        """Named at load, not as non-finite logits at the first step."""
        d = tiny(tmp_path, "tiny-llama-tied")
        w = d / "model.safetensors"
        raw = bytearray(w.read_bytes())
        length = int.from_bytes(raw[:8], "little")
        norm = json.loads(raw[8:8 + length])["model.norm.weight"]
        assert norm["dtype"] == "BF16"
        at = 8 + length + norm["data_offsets"][0] + 2 * 5
        raw[at:at + 2] = (0x7FC0).to_bytes(2, "little")      # a bf16 NaN in its sixth value
        w.write_bytes(raw)
        refused(tmp_path, ModelFileError, f"{w}: tensor 'model.norm.weight' holds a value that is not finite", load(d),
                peak=64 << 20)

    def test_an_index_naming_a_path(self, tmp_path):
        d = tiny(tmp_path, "tiny-llama")
        index = json.loads((d / hf.INDEX_NAME).read_text())
        index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
        (d / hf.INDEX_NAME).write_text(json.dumps(index))
        refused(tmp_path, ModelFileError, f"{d}/{hf.INDEX_NAME}: field 'weight_map' maps 'model.norm.weight' to "
                                          '"../../etc/passwd", which is not a plain file name', load(d))

    @pytest.mark.parametrize("fixture, changes, problem", [
        ("tiny-llama", {"rope_theta": 5e-324, "rope_parameters": None},
         "field 'rope_theta' is 5e-324: it gives rotary frequencies that are not finite and > 0 (with head_dim 16)"),
        ("tiny-llama", {"rope_scaling": []}, "field 'rope_scaling' is [], expected a JSON object"),
        ("tiny-llama", {"rope_parameters": {"rope_type": ["llama3"]}},
         "field 'rope_parameters.rope_type' is [\"llama3\"], a variant tilekit does not compute"),
        ("tiny-llama", {"rope_parameters": None, "rope_scaling": {"type": {}}},
         "field 'rope_scaling.type' is {}, a variant tilekit does not compute"),
        ("tiny-llama", {"eos_token_id": []}, "field 'eos_token_id' is [], expected a token id or a non-empty list of "
                                             "them (integers in [0, 259))"),
        ("tiny-llama", {"num_hidden_layers": 2.7}, "field 'num_hidden_layers' is 2.7, expected an integer in "
                                                   "[1, 4096]"),
        ("tiny-llama", {"num_hidden_layers": True}, "field 'num_hidden_layers' is true, expected an integer in "
                                                    "[1, 4096]"),
        ("tiny-gpt2", {"layer_norm_epsilon": 0}, "field 'layer_norm_epsilon' is 0, expected a finite number > 0"),
        ("tiny-gpt2", {"model_type": "gpt_bigcode"}, 'field \'model_type\' is "gpt_bigcode", expected one of "gpt2", '
                                                     '"llama", "deepseek_v2"'),
        ("tiny-gpt2", {"eos_token_id": 1031}, "field 'eos_token_id' is 1031, expected a token id or a non-empty list "
                                              "of them (integers in [0, 1031))"),
        ("tiny-gpt2", {"n_head": 3}, "field 'n_embd' is 64, not a multiple of n_head (3)"),
    ])
    def test_config_fields(self, tmp_path, fixture, changes, problem):
        d = tiny(tmp_path, fixture)
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({k: v for k, v in {**config, **changes}.items() if v is not None}))
        refused(tmp_path, ModelFileError, f"{d}/config.json: {problem}", load(d))
        refused(tmp_path, ModelFileError, f"{d}/config.json: {problem}", lambda: families.config_from_path(d))

    @pytest.mark.parametrize("changes, problem", [
        ({"rope_parameters": dict(DS_YARN, rope_theta=1.0)},
         "field 'rope_parameters.rope_theta' is 1.0: it leaves YaRN's correction range undefined (with beta_fast "
         "32.0, beta_slow 1.0)"),
        ({"rope_parameters": dict(DS_YARN, beta_fast=5e-324, beta_slow=5e-324)},
         "field 'rope_parameters.rope_theta' is 10000.0: it leaves YaRN's correction range undefined (with "
         "beta_fast 5e-324, beta_slow 5e-324)"),
        ({"rope_theta": 5e-324},
         "field 'rope_theta' is 5e-324: it gives rotary frequencies that are not finite and > 0 (with "
         "qk_rope_head_dim 16)"),
    ])
    def test_deepseek_rope(self, tmp_path, changes, problem):
        d = tiny(tmp_path, "tiny-deepseek-v2")
        config = json.loads((d / "config.json").read_text())
        config.pop("rope_parameters")
        (d / "config.json").write_text(json.dumps({**config, **changes}))
        refused(tmp_path, ModelFileError, f"{d}/config.json: {problem}", load(d))
        refused(tmp_path, ModelFileError, f"{d}/config.json: {problem}", lambda: families.config_from_path(d))

    def test_a_gpt_bigcode_config_is_not_gpt2(self, tmp_path):
        d = tiny(tmp_path, "tiny-gpt2")
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(config, model_type="gpt_bigcode")))
        refused(tmp_path, ModelFileError, f'{d}/config.json: field \'model_type\' is "gpt_bigcode", expected one of '
                                          '"gpt2"', load(d, GPT))
        refused(tmp_path, ModelFileError, f'{DATA}/tiny-gpt2/config.json: field \'model_type\' is "gpt2", expected '
                                          'one of "llama"', load(DATA / "tiny-gpt2", Llama))

    @pytest.mark.parametrize("text, problem", [
        ('{"eos_token_id": []}', "field 'eos_token_id' is [], expected a token id or a non-empty list of them "
                                 "(integers >= 0)"),
        ('{"do_sample": 1}', "do_sample must be true or false, got 1"),
        ('{"temperature": 1e400}', "not strict JSON (1e400 is out of range)"),
        ('{"top_k": 2.7, "do_sample": true}', "top_k must be an int >= 0 and <= 1073741824, got 2.7"),
        ('{"top_k": 4294967301}', "top_k must be an int >= 0 and <= 1073741824, got 4294967301"),
        ('{"min_new_tokens": 100000000000000000000000}', "min_new_tokens must be an int >= 0 and <= 1073741824, got "
                                                         "100000000000000000000000"),
    ])
    def test_generation_config(self, tmp_path, text, problem):
        d = tiny(tmp_path, "tiny-llama")
        (d / "generation_config.json").write_text(text)
        refused(tmp_path, ModelFileError, f"{d}/generation_config.json: {problem}",
                lambda: GenerationSettings.from_generation_config(d))

    @pytest.mark.parametrize("content, problem", [
        (b"\xffgarbage", "is not UTF-8 text (invalid start byte at byte 0)"),
        (b'{"version": "1.0", "model": {"type": "\x1b[2J"}}', "is not a tokenizer ("),
        (b"[]", "is not a tokenizer ("),
    ])
    def test_a_garbage_tokenizer(self, tmp_path, content, problem):
        d = tiny(tmp_path, "tiny-gpt2")
        (d / "tokenizer.json").write_bytes(content)
        with pytest.raises(ModelFileError) as info:
            load_tokenizer(d)
        assert str(info.value).startswith(f"{d}/tokenizer.json: {problem}") and "\x1b" not in str(info.value)

    def test_control_characters(self, tmp_path):
        d = tiny(tmp_path, "tiny-llama-tied")
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(config, hidden_act="\x1b]0;owned\x07")))
        refused(tmp_path, ModelFileError, f"{d}/config.json: field 'hidden_act' is \"\\u001b]0;owned\\u0007\", a "
                                          "variant tilekit does not compute", load(d))
        (d / "config.json").write_text(json.dumps(config))
        state = Llama.weights.load_state_dict(d)[1]
        save_file(dict(state, **{"\x1b[2J\nFAKE": np.ones(1, np.float32)}), d / "model.safetensors")
        with pytest.raises(ModelFileError) as info:
            load(d)()
        assert str(info.value).endswith(":\n  unexpected tensor '\\x1b[2J\\nFAKE'")

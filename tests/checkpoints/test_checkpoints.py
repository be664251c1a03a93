"""tilekit.checkpoints: finding checkpoints, typed config fields, safetensors headers, streaming loads (on the host
device, and on one whose copies land late, as a GPU's do), writing checkpoints, the progress bar.
Hostile files are tests/checkpoints/test_hostile_model_files.py's."""

import contextlib
import io
import json
import os
import threading
import tracemalloc
from collections import deque
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from tilekit.autotune.arrays import numpy_dtype
from tilekit import checkpoints as hf
from tilekit.checkpoints import Fields, HostDevice, ModelFileError, Target

BF16 = np.dtype(ml_dtypes.bfloat16)
NP = {"BF16": BF16, "F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}


def safetensors_bytes(header, data: bytes = b"") -> bytes:
    """A safetensors file by hand: `header` (a dict, or the header's bytes) after its length, then `data`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def checkpoint(directory: Path, tensors: dict, dtype="float32", shard_bytes=None, config=None) -> hf.Checkpoint:
    hf.write_checkpoint(directory, config or {"model_type": "test"}, tensors, dtype=dtype, shard_bytes=shard_bytes)
    return hf.find_checkpoint(directory)


def fresh(seed: int, shapes: dict) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def load(ck: hf.Checkpoint, plan: dict, **kw) -> dict:
    with ck.tensor_files() as files:
        return hf.load_tensors(files, plan, device=kw.pop("device", HostDevice()), **kw)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


# -- finding checkpoints ------------------------------------------------------------------------------------

@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    for name in ("HF_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


def snapshot(hub: Path, repo_id: str, revision: str, tensors: dict, shard_bytes=None) -> Path:
    """A hub-cache snapshot as huggingface_hub lays it out: each file a relative link to ../../blobs/<hash>."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    staging = repo / "staging" / revision
    hf.write_checkpoint(staging, {"model_type": "test", "revision": revision}, tensors, shard_bytes=shard_bytes)
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    directory = repo / "snapshots" / revision
    directory.mkdir(parents=True)
    for i, f in enumerate(sorted(staging.iterdir())):
        blob = f"{revision}{i:04d}"
        f.rename(repo / "blobs" / blob)
        (directory / f.name).symlink_to(Path("..", "..", "blobs", blob))
    staging.rmdir()
    return directory


def test_a_directory_is_a_checkpoint(tmp_path, monkeypatch):
    ck = checkpoint(tmp_path / "ck", fresh(0, {"w": (2, 3)}))
    assert ck == hf.Checkpoint(tmp_path / "ck", (str(tmp_path / "ck"),))
    monkeypatch.chdir(tmp_path)
    assert hf.find_checkpoint("ck") == ck and hf.find_checkpoint(Path("ck")) == ck
    (tmp_path / "link").symlink_to(tmp_path / "ck")            # a linked directory: its files resolve in the target
    assert hf.find_checkpoint("link").roots == (str(tmp_path / "ck"),)
    assert ck.config().choice("model_type", ("test",)) == "test"


def test_a_hub_name_takes_refs_main_then_the_newest_complete_snapshot(hf_home):
    main = snapshot(hf_home, "org/model", "aaaa1111", fresh(1, {"w": (2,)}))
    newer = snapshot(hf_home, "org/model", "bbbb2222", fresh(2, {"w": (2,)}), shard_bytes=4)
    os.utime(main, (1, 1))
    assert hf.find_checkpoint("org/model").directory == newer        # no refs/main: the newest
    (hf_home / "models--org--model" / "refs").mkdir()
    (hf_home / "models--org--model" / "refs" / "main").write_text("aaaa1111")
    ck = hf.find_checkpoint("model", orgs=("other", "org"))          # a bare name, looked up under each org
    assert ck.directory == main and ck.roots == (str(main), str(hf_home / "models--org--model" / "blobs"))
    assert ck.config().d["revision"] == "aaaa1111"
    (main / "model.safetensors").unlink()                           # refs/main's snapshot incomplete: the next
    assert hf.find_checkpoint("org/model").directory == newer
    with hf.find_checkpoint(newer).tensor_files() as files:         # a snapshot named directly reads its blobs
        assert list(files.tensors) == ["w"] and files.source == newer / hf.INDEX_NAME


def test_nothing_found_says_where_it_looked(hf_home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (hf_home / "models--org--gpt" / "snapshots" / "cccc3333").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as info:
        hf.find_checkpoint("gpt", orgs=("org",))
    assert str(info.value) == (
        f"no checkpoint 'gpt'; searched: {tmp_path / 'gpt'}; {hf_home / 'models--gpt' / 'snapshots'}; "
        f"{hf_home / 'models--org--gpt' / 'snapshots' / 'cccc3333' / 'config.json'}: no such file")


# -- config fields ------------------------------------------------------------------------------------------

def test_fields_read_typed_values_and_defaults():
    f = Fields({"n": 3, "eps": 1, "tied": False, "act": "silu", "eos": [1, 2], "bos": 0, "head_dim": None,
                "rope": {"factor": 8.0, "type": "llama3"}, "unknown": object()}, "config.json")
    assert (f.integer("n", low=1), f.number("eps", positive=True), f.boolean("tied"), f.choice("act", ("silu",)),
            f.token_ids("eos", vocab=3), f.token_ids("bos")) == (3, 1.0, False, "silu", (1, 2), 0)
    assert type(f.number("eps")) is float
    assert f.integer("head_dim", None) is None and f.integer("absent", 7) == 7 and f.number("absent", None) is None
    rope = f.object("rope")
    assert (rope.number("factor", low=1.0), rope.choice("type", ("llama3",)), "factor" in rope) == (8.0, "llama3", True)
    assert f.object("absent", None) is None and f.object("absent", {}).d == {}
    with pytest.raises(ModelFileError) as info:
        rope.integer("factor")
    assert str(info.value) == "config.json: field 'rope.factor' is 8.0, expected an integer"


# -- safetensors headers ------------------------------------------------------------------------------------

def test_headers_agree_with_the_safetensors_library(tmp_path):
    tensors = {"b": np.ones((2, 3), BF16), "h": np.ones(5, np.float16), "f": np.ones((1, 1, 2), np.float32),
               "d": np.ones(1, np.float64), "i": np.ones(3, np.int64), "u": np.ones(0, np.uint8),
               "k": np.ones(2, np.int8), "z": np.ones(4, bool)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    with hf.RegularFile(tmp_path / "x.safetensors") as f, safe_open(tmp_path / "x.safetensors", "np") as g:
        header = hf.read_header(f)
        assert header.keys() == tensors.keys()
        for name, t in header.items():
            assert (t.dtype, list(t.shape)) == (g.get_slice(name).get_dtype(), g.get_slice(name).get_shape())
            data = np.frombuffer(f.read(t.nbytes, t.start), tensors[name].dtype).reshape(t.shape)
            assert np.array_equal(data, g.get_tensor(name))


def test_fp8_headers_parse(tmp_path):
    e4m3 = np.array([0.5, -2, 448], ml_dtypes.float8_e4m3fn)
    path = tmp_path / "x.safetensors"
    path.write_bytes(safetensors_bytes({"a": {"dtype": "F8_E4M3", "shape": [3], "data_offsets": [0, 3]},
                                        "b": {"dtype": "F8_E5M2", "shape": [1, 1], "data_offsets": [3, 4]}},
                                       e4m3.tobytes() + b"\x3c"))
    with hf.RegularFile(path) as f:
        assert {n: (t.dtype, t.shape, t.nbytes) for n, t in hf.read_header(f).items()} == {
            "a": ("F8_E4M3", (3,), 3), "b": ("F8_E5M2", (1, 1), 1)}


def test_model_safetensors_wins_over_an_index_and_files_close(tmp_path):
    ck = checkpoint(tmp_path, fresh(3, {"a": (4,), "b": (3,)}), shard_bytes=16)
    with ck.tensor_files() as files:
        assert (files.source, sorted(files.tensors), len(files.files)) == (tmp_path / hf.INDEX_NAME, ["a", "b"], 2)
    fds = len(os.listdir("/proc/self/fd"))
    save_file({"c": np.zeros(1, np.float32)}, tmp_path / hf.WEIGHTS_NAME)     # as in transformers
    files = ck.tensor_files()
    assert (files.source, list(files.tensors)) == (tmp_path / hf.WEIGHTS_NAME, ["c"])
    files.close()
    assert len(os.listdir("/proc/self/fd")) == fds


# -- loading ------------------------------------------------------------------------------------------------

SPECIAL = np.array([0.0, -0.0, 1.0, -1.5, 1 + 2 ** -8, 1 + 3 * 2 ** -9, 65504.0, 65519.0, 7e4, 1e-40, 6e-8, 3e38],
                   np.float32)


@pytest.mark.parametrize("source", ["BF16", "F16", "F32"])
def test_every_dtype_converts_as_numpy_casts(tmp_path, source):
    """Ties, the largest finite values, subnormals, signed zeros: each target holds what NumPy's cast gives (values
    a cast makes infinite are refused: tests/checkpoints/test_hostile_model_files.py)."""
    for dtype in hf.TARGET_DTYPES:
        target = np.dtype(numpy_dtype(dtype))
        with np.errstate(over="ignore"):
            fit = SPECIAL[np.isfinite(SPECIAL.astype(NP[source]).astype(target).astype(np.float64))]
        values = np.concatenate([fit, np.random.default_rng(4).standard_normal(50, np.float32)]).astype(NP[source])
        save_file({"x": values}, tmp_path / hf.WEIGHTS_NAME)
        (tmp_path / hf.CONFIG_NAME).write_text("{}")
        out = load(hf.find_checkpoint(tmp_path), {"x": Target(values.shape, dtype)})["x"]
        assert out.dtype == target and np.array_equal(bits(out), bits(values.astype(out.dtype))), dtype


class LateCopies(HostDevice):
    """Copies land only when waited for, before the work queued behind them (a conversion, a finite check), or at
    synchronize, as a GPU's complete late: a staging buffer read into again before its copy finished shows as wrong
    data."""

    def __init__(self):
        self.pending, self.lock, self.queued, self.landed = deque(), threading.Lock(), 0, 0

    def upload(self, host, raw):
        with self.lock:
            self.pending.append((host, raw))
            self.queued += 1
            mark = self.queued
        return lambda: self.land(mark)

    def land(self, upto=None):
        with self.lock:
            while self.pending and (upto is None or self.landed < upto):
                host, raw = self.pending.popleft()
                raw[...] = host
                self.landed += 1

    def after_copies(self):      # the work behind the copies waits for them
        self.land()
        return contextlib.nullcontext()

    def synchronize(self):
        self.land()


SHAPES = {"emb": (37, 11), "qkv": (23, 11), "norm": (11,), "empty": (0, 3), "head": (5, 11, 2)}


@pytest.mark.parametrize("buffers, buffer_bytes", [(1, 7), (2, 64), (3, 50), (4, 10 ** 6)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pieces_through_a_ring_of_staging_buffers(tmp_path, buffers, buffer_bytes, dtype):
    """Tensors larger than a buffer go in pieces, whatever the piece size; bf16 files into bf16 outputs are copied
    straight in, float32 ones converted from scratch."""
    state = fresh(5, SHAPES)
    ck = checkpoint(tmp_path, state, dtype="bfloat16", shard_bytes=700)
    out = load(ck, {n: Target(s, dtype) for n, s in SHAPES.items()}, device=LateCopies(), buffers=buffers,
               buffer_bytes=buffer_bytes)
    assert out.keys() == state.keys()
    for name, a in state.items():
        assert np.array_equal(bits(out[name]), bits(a.astype(BF16).astype(numpy_dtype(dtype)))), name


def test_late_copies_catch_a_staging_buffer_reused_too_early(tmp_path, monkeypatch):
    """The check above can fail: reading without waiting for the copy out of the buffer garbles tensors."""
    state = fresh(6, SHAPES)
    ck = checkpoint(tmp_path, state)
    read = hf.LoadStream.read
    monkeypatch.setattr(hf.LoadStream, "read", lambda self, k, copied: read(self, k, None))
    out = load(ck, {n: Target(s, "float32") for n, s in SHAPES.items()}, device=LateCopies(), buffers=2,
               buffer_bytes=64)
    assert not all(np.array_equal(out[n], a) for n, a in state.items())


def test_outputs_are_views_of_fused_arrays_or_made_on_demand(tmp_path):
    """Rows of a fused weight take a tensor straight; columns (not contiguous) take it through scratch; an
    allocator runs when its tensor is reached; nothing outside the views is touched."""
    state = fresh(7, {"q": (4, 3), "k": (2, 3), "v": (2, 3), "up": (3, 5), "gate": (3, 5), "n": (3,)})
    ck = checkpoint(tmp_path, state, dtype="bfloat16")
    qkv = np.full((9, 3), np.nan, BF16)
    up_gate = np.full((3, 11), np.nan, np.float32)
    made = []
    plan = {"q": Target((4, 3), out=qkv[:4]), "k": Target((2, 3), out=qkv[4:6]), "v": Target((2, 3), out=qkv[6:8]),
            "up": Target((3, 5), "float32", out=up_gate[:, :5]), "gate": Target((3, 5), "float32", out=up_gate[:, 6:]),
            "n": Target((3,), "float16", out=lambda: made.append("n") or np.zeros(3, np.float16))}
    out = load(ck, plan)
    as_bf16 = {n: a.astype(BF16) for n, a in state.items()}
    assert np.array_equal(qkv[:8], np.concatenate([as_bf16["q"], as_bf16["k"], as_bf16["v"]]))
    assert np.isnan(qkv[8].astype(np.float32)).all() and np.isnan(up_gate[:, 5]).all()
    assert np.array_equal(up_gate[:, :5], as_bf16["up"].astype(np.float32))
    assert np.array_equal(up_gate[:, 6:], as_bf16["gate"].astype(np.float32))
    assert made == ["n"] and out["n"].dtype == np.float16 and out["q"].base is qkv


def test_a_transform_gets_the_files_tensor(tmp_path):
    """A transform replaces the plain conversion: a transpose, and FP8 dequantised from its bit patterns."""
    w = fresh(8, {"w": (3, 5)})["w"]
    fp8 = np.array([0.5, -2, 448, 0.0078125], ml_dtypes.float8_e4m3fn)
    (tmp_path / hf.CONFIG_NAME).write_text("{}")
    (tmp_path / hf.WEIGHTS_NAME).write_bytes(safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 60]},
         "s": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [60, 64]}}, w.tobytes() + fp8.tobytes()))
    seen = []

    def dequantise(src, out):
        seen.append(src.dtype)
        hf.convert(src.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * 2, out)
    out = load(hf.find_checkpoint(tmp_path), {
        "w": Target((3, 5), "float32", out=np.empty((5, 3), np.float32), transform=lambda src, o: hf.convert(src.T, o)),
        "s": Target((4,), "float32", transform=dequantise, accept=("F8_E4M3",))})
    assert np.array_equal(out["w"], w.T) and seen == [np.uint8]
    assert out["s"].tolist() == [1.0, -4.0, 896.0, 0.015625]


def test_optional_and_ignored_tensors(tmp_path):
    ck = checkpoint(tmp_path, fresh(9, {"w": (2,), "h.0.attn.bias": (1, 1), "rotary.inv_freq": (2,)}))
    out = load(ck, {"w": Target((2,), "float32"), "lm_head": Target((2,), optional=True)},
               ignore=(".attn.bias", ".inv_freq"))
    assert list(out) == ["w"]


def test_a_mismatch_lists_every_problem(tmp_path):
    (tmp_path / hf.CONFIG_NAME).write_text("{}")
    save_file({"w": np.zeros((2, 3), np.float32), "i": np.zeros(2, np.int64),
               **{f"extra.{i}": np.zeros(1, np.float32) for i in range(8)}}, tmp_path / hf.WEIGHTS_NAME)
    with pytest.raises(ModelFileError) as info:
        load(hf.find_checkpoint(tmp_path), {"w": Target((3, 2)), "i": Target((2,)), "gone": Target((4,))},
             expected="TinyConfig(n=2)")
    assert str(info.value) == "\n  ".join([
        f"{tmp_path / hf.WEIGHTS_NAME}: does not match TinyConfig(n=2):",   # in the header's order, missing last
        "tensor 'i' has dtype I64, expected BF16 or F16 or F32", *[f"unexpected tensor 'extra.{i}'" for i in range(8)],
        "tensor 'w' has shape (2, 3), expected (3, 2)", "... and 1 more"])


def test_plan_mistakes_are_value_errors_before_anything_is_read(tmp_path):
    ck = checkpoint(tmp_path, fresh(10, {"w": (2, 3)}))
    for target, message in [
            (Target((2, 3), out=np.empty((3, 2), BF16)),
             "plan for 'w': out is bfloat16 (3, 2), expected bfloat16 (2, 3)"),
            (Target((2, 3), "float32", out=np.empty((2, 3), BF16)), "out is bfloat16 (2, 3), expected float32 (2, 3)"),
            (Target((2, 3), "int8"),
             "plan for 'w': dtype must be one of ('bfloat16', 'float16', 'float32', 'float64'), got 'int8'"),
            (Target((2, 3), accept=("F32", "F8_E4M3")), "accepting FP8 needs a transform (FP8 arrives as uint8 bits)")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load(ck, {"w": target})
    with pytest.raises(ValueError, match=r"plan for 'w': out is float32 \(2, 3\), expected bfloat16 \(2, 3\)"):
        load(ck, {"w": Target((2, 3), out=lambda: np.empty((2, 3), np.float32))})
    with pytest.raises(ValueError, match="buffers and buffer_bytes must be positive, got 0 and 65536"):
        load(ck, {"w": Target((2, 3))}, buffers=0, buffer_bytes=1 << 16)


def test_host_memory_is_the_staging_buffers(tmp_path):
    """An 8 MB checkpoint into outputs allocated beforehand: the load itself allocates its four 64 KB buffers and
    little else (no tensor, no file, on the host); the ring is its `buffers`, not more."""
    shapes = {f"w{i}": (256, 1024) for i in range(8)}
    ck = checkpoint(tmp_path, {n: np.ones(s, np.float32) for n, s in shapes.items()})
    outs = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    tracemalloc.start()
    try:
        load(ck, {n: Target(s, "float32", out=outs[n]) for n, s in shapes.items()}, buffers=4, buffer_bytes=64 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 4 * 64 << 10 <= peak < (4 * 64 << 10) + (256 << 10), peak
    assert all(o.min() == 1 for o in outs.values())


def test_a_file_that_shrinks_after_its_header_was_read(tmp_path):
    ck = checkpoint(tmp_path, {"w": np.ones(100, np.float32)})
    with ck.tensor_files() as files:
        os.truncate(tmp_path / hf.WEIGHTS_NAME, files.tensors["w"].start + 100)
        with pytest.raises(ModelFileError) as info:
            hf.load_tensors(files, {"w": Target((100,))}, device=HostDevice())
    assert str(info.value) == (f"{tmp_path / hf.WEIGHTS_NAME}: ends at byte {files.tensors['w'].start + 100}, before "
                               f"byte {files.tensors['w'].end} (it shrank after its header was read)")


def test_an_empty_plan_reads_nothing(tmp_path):
    ck = checkpoint(tmp_path, {})
    assert load(ck, {}) == {}


# -- writing ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, code", [("float32", "F32"), ("bfloat16", "BF16"), ("float16", "F16")])
def test_written_files_read_back_with_the_safetensors_library(tmp_path, dtype, code):
    state = fresh(11, {"a": (3, 4), "b": (5,), "c": ()})
    hf.write_checkpoint(tmp_path, {"model_type": "test", "x": [1, 2]}, state, dtype=dtype)
    assert json.loads((tmp_path / hf.CONFIG_NAME).read_text()) == {"model_type": "test", "x": [1, 2]}
    with safe_open(tmp_path / hf.WEIGHTS_NAME, "np") as f:
        assert f.metadata() == {"format": "pt"} and list(f.keys()) == ["a", "b", "c"]
        for name, a in state.items():
            assert f.get_slice(name).get_dtype() == code
            assert np.array_equal(bits(f.get_tensor(name)), bits(a.astype(numpy_dtype(dtype))))
    assert sorted(p.name for p in tmp_path.iterdir()) == [hf.CONFIG_NAME, hf.WEIGHTS_NAME]


def test_shards_split_as_save_pretrained_does(tmp_path):
    state = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32), "big": np.ones(10, np.float32),
             "c": np.ones(1, np.float32)}
    hf.write_checkpoint(tmp_path, {}, state, shard_bytes=20)     # a+b fit in 20 bytes; big alone; c
    index = json.loads((tmp_path / hf.INDEX_NAME).read_text())
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index == {"metadata": {"total_size": 64},
                     "weight_map": {"a": names[0], "b": names[0], "big": names[1], "c": names[2]}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [hf.CONFIG_NAME, *names, hf.INDEX_NAME]
    out = load(hf.find_checkpoint(tmp_path), {n: Target(a.shape, "float32") for n, a in state.items()})
    assert all(np.array_equal(out[n], a) for n, a in state.items())
    hf.write_checkpoint(tmp_path, {}, state)                     # the single-file layout replaces the shards
    assert sorted(p.name for p in tmp_path.iterdir()) == [hf.CONFIG_NAME, hf.WEIGHTS_NAME]


def test_writing_replaces_links_and_refuses_bad_input_before_writing(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / hf.WEIGHTS_NAME).symlink_to(victim)
    hf.write_checkpoint(tmp_path / "ck", {}, {"w": np.ones(2, np.float32)})
    assert victim.read_text() == "precious" and not (tmp_path / "ck" / hf.WEIGHTS_NAME).is_symlink()
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        hf.write_checkpoint(tmp_path / "ck2", {"eps": float("nan")}, {})
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16', 'float16'\), got 'int8'"):
        hf.write_checkpoint(tmp_path / "ck2", {}, {}, dtype="int8")
    assert sorted(tmp_path.rglob("*")) == before


# -- progress -----------------------------------------------------------------------------------------------

class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_shows_only_on_a_terminal_after_two_seconds():
    now = [0.0]
    term = Terminal()
    bar = hf.Progress("loading ck", stream=term, clock=lambda: now[0])
    bar.update(1 * 10 ** 9, 4 * 10 ** 9)
    now[0] = 2.5
    bar.update(2 * 10 ** 9, 4 * 10 ** 9)
    now[0] = 2.55
    bar.update(3 * 10 ** 9, 4 * 10 ** 9)                                  # within a tenth of a second: not redrawn
    now[0] = 4.0
    bar.update(4 * 10 ** 9, 4 * 10 ** 9)
    bar.close()
    assert term.getvalue() == "\rloading ck:  50% 2.0/4.0 GB 0.8 GB/s \rloading ck: 100% 4.0/4.0 GB 1.0 GB/s \n"
    pipe = io.StringIO()
    bar = hf.Progress("loading ck", stream=pipe, clock=lambda: now[0])
    now[0] = 100.0
    bar.update(1, 1)
    bar.close()
    assert pipe.getvalue() == ""


def test_progress_counts_what_it_is_given_a_unit_of():
    now = [0.0]
    term = Terminal()
    bar = hf.Progress("compiling", stream=term, clock=lambda: now[0], unit="kernels")
    now[0] = 3.0
    bar.update(62, 163)
    bar.close()
    assert term.getvalue() == "\rcompiling:  38% 62/163 kernels \n"


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-llama-tied"])
def test_files_transformers_wrote_load_as_the_safetensors_library_reads_them(name):
    """The committed fixtures (save_pretrained's headers, shards and index) pass every check, value for value."""
    directory = Path(__file__).resolve().parents[1] / "data" / name
    expected = {}
    for path in directory.glob("*.safetensors"):
        expected.update(load_file(path))
    with hf.find_checkpoint(directory).tensor_files() as files:
        assert len(files.files) == len(list(directory.glob("*.safetensors")))
        out = hf.load_tensors(files, {n: Target(a.shape, "float32") for n, a in expected.items()}, device=HostDevice())
    assert all(np.array_equal(out[n], a.astype(np.float32)) for n, a in expected.items())


def test_a_missing_hub_cache_is_named_with_the_variable_that_placed_it(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-typo"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        hf.find_checkpoint("m", orgs=("org",))
    cache = tmp_path / "hf-typo" / "hub"
    assert str(info.value) == (f"no checkpoint 'm'; searched: {tmp_path}/m; {cache}/models--m/snapshots; "
                               f"{cache}/models--org--m/snapshots; {cache}: no such directory (the hub cache, from "
                               "HF_HOME)")

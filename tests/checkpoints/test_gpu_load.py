"""The streaming loader on the GPU (tilekit.checkpoints.stream.CupyDevice): pinned staging buffers, copies queued on a
stream while the next pieces are read, conversions in CuPy; against the host device's NumPy results bit for bit,
into NaN-poisoned outputs; and host memory bounded by the staging buffers."""

import gc

import ml_dtypes
import numpy as np
import pytest

from tilekit.autotune.arrays import numpy_dtype
from tilekit.kernels.checks import poisoned
from tilekit import checkpoints as hf
from tilekit.checkpoints import CupyDevice, HostDevice, Target

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

SPECIAL = np.array([0.0, -0.0, 1.0, -1.5, 1 + 2 ** -8, 1 + 3 * 2 ** -9, 65504.0, 65519.0, 7e4, 1e-40, 6e-8, 3e38],
                   np.float32)


def load(directory, plan, device, **kw):
    with hf.find_checkpoint(directory).tensor_files() as files:
        return hf.load_tensors(files, plan, device=device, **kw)


def bits(a) -> np.ndarray:
    a = cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a
    return a.view(f"u{a.dtype.itemsize}")


def same(gpu, expected: np.ndarray) -> bool:
    """Equal bit for bit, except that any NaN matches any NaN (payloads differ between CUDA and ml_dtypes)."""
    got = cupy.asnumpy(gpu)
    nan = np.isnan(expected.astype(np.float64))
    return bool((np.isnan(got.astype(np.float64)) == nan).all() and (bits(got)[~nan] == bits(expected)[~nan]).all())


@pytest.mark.parametrize("source", ["bfloat16", "float16", "float32"])
def test_conversions_match_numpy(tmp_path, source):
    """Each file dtype into each target dtype, rounding ties, the largest finite values, subnormals and signed zeros
    included (what a conversion would make infinite is refused: test_non_finite_values_are_refused_alike)."""
    for dtype in hf.CupyDevice.dtypes:
        with np.errstate(over="ignore"):
            fit = SPECIAL[np.isfinite(SPECIAL.astype(numpy_dtype(source)).astype(numpy_dtype(dtype))
                                      .astype(np.float64))]
        values = np.concatenate([fit, np.random.default_rng(0).standard_normal(4099, np.float32)])
        hf.write_checkpoint(tmp_path / dtype, {}, {"x": values.reshape(-1, 1)}, dtype=source)
        expected = load(tmp_path / dtype, {"x": Target((len(values), 1), dtype)}, HostDevice())["x"]
        got = load(tmp_path / dtype, {"x": Target((len(values), 1), dtype)}, CupyDevice(), buffer_bytes=1000, buffers=2)
        assert isinstance(got["x"], cupy.ndarray) and same(got["x"], expected), (source, dtype)


@pytest.mark.parametrize("source", ["bfloat16", "float16", "float32"])
def test_non_finite_values_are_refused_alike(tmp_path, source):
    """An infinity or a NaN in the file, in one piece of a tensor streamed in several, and (float32 files) a value
    too large for a float16 model: the GPU loader's error is the host's."""
    rng = np.random.default_rng()
    cases = [(value, dtype, "holds a value that is not finite") for value in (np.inf, -np.inf, np.nan)
             for dtype in hf.CupyDevice.dtypes]
    if source == "float32":
        cases.append((7e4, "float16", "holds a value too large for float16"))
    for value, dtype, problem in cases:
        values = rng.standard_normal(5000).astype(np.float32)
        values[rng.integers(len(values))] = value
        hf.write_checkpoint(tmp_path, {}, {"ok": np.ones((3, 1), np.float32), "x": values.reshape(-1, 1)}, dtype=source)
        plan = {"ok": Target((3, 1), dtype), "x": Target((len(values), 1), dtype)}
        for device in (HostDevice(), CupyDevice()):
            with pytest.raises(hf.ModelFileError) as info:
                load(tmp_path, plan, device, buffer_bytes=1000, buffers=2)
            assert str(info.value) == f"{tmp_path}/model.safetensors: tensor 'x' {problem}", (value, dtype, device)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_a_nan_fp8_code_is_refused_alike(tmp_path, code):
    """FP8 e4m3 codes (no infinity: 0x7F and 0xFF are its NaNs), one of them in one piece of a tensor streamed in
    several: the GPU loader's error is the host's; the same codes without it (every other code, +-448 included)
    load bit for bit."""
    rng = np.random.default_rng()
    ok = rng.integers(0, 256, 5000, dtype=np.uint8)
    ok[(ok & 0x7F) == 0x7F] -= 1                      # 0x7E, 0xFE: +-448, the largest finite codes
    bad = ok.copy()
    at = rng.integers(len(bad))
    bad[at] = code

    def keep(src, out):
        out[...] = src                                 # the codes as numbers

    plan = {"x": Target((len(ok), 1), "float32", transform=keep, accept=("F8_E4M3",))}
    hf.write_checkpoint(tmp_path, {}, {"x": ok.reshape(-1, 1)}, raw={"x": "F8_E4M3"})
    got = load(tmp_path, plan, CupyDevice(), buffer_bytes=1000, buffers=2)["x"]
    assert (cupy.asnumpy(got).reshape(-1) == ok).all()
    hf.write_checkpoint(tmp_path, {}, {"x": bad.reshape(-1, 1)}, raw={"x": "F8_E4M3"})
    for device in (HostDevice(), CupyDevice()):
        with pytest.raises(hf.ModelFileError) as info:
            load(tmp_path, plan, device, buffer_bytes=1000, buffers=2)
        assert str(info.value) == f"{tmp_path}/model.safetensors: tensor 'x' holds a value that is not finite", \
            (device, at)


@pytest.mark.parametrize("buffers, buffer_bytes", [(1, 1 << 20), (3, 1 << 20), (4, 7 << 20), (4, 64 << 20)])
def test_many_pieces_through_the_ring(tmp_path, buffers, buffer_bytes):
    """96 MB of fresh random tensors in up to a hundred pieces: a staging buffer refilled before its copy ended,
    or a conversion run before its copies, would show as wrong values."""
    rng = np.random.default_rng()
    shapes = {"emb": (8192, 2048), "a": (2048, 2048), "b": (3, 5), "c": (0, 4), "d": (4096, 1536)}
    state = {n: rng.standard_normal(s, np.float32) for n, s in shapes.items()}
    hf.write_checkpoint(tmp_path, {}, state, dtype="bfloat16", shard_bytes=40 << 20)
    for dtype in ("bfloat16", "float32"):               # copied straight into the outputs; converted from scratch
        outs = {n: poisoned(s, dtype) for n, s in shapes.items()}
        got = load(tmp_path, {n: Target(s, dtype, out=outs[n]) for n, s in shapes.items()}, CupyDevice(),
                   buffers=buffers, buffer_bytes=buffer_bytes)
        for name, a in state.items():
            assert got[name] is outs[name]
            assert same(got[name], a.astype(ml_dtypes.bfloat16).astype(numpy_dtype(dtype))), (name, dtype)


def test_views_allocators_and_transforms(tmp_path):
    """Rows of a fused qkv weight (straight copies into a view), columns of a fused gate/up (strided: through
    scratch), an allocator, a transpose; nothing outside the views is written."""
    rng = np.random.default_rng()
    state = {n: rng.standard_normal(s, np.float32) for n, s in
             {"q": (64, 48), "k": (16, 48), "v": (16, 48), "gate": (48, 40), "up": (48, 40), "w": (48, 24)}.items()}
    hf.write_checkpoint(tmp_path, {}, state, dtype="bfloat16")
    qkv, gate_up = poisoned((97, 48), "bfloat16"), poisoned((48, 81), "float16")
    plan = {"q": Target((64, 48), out=qkv[:64]), "k": Target((16, 48), out=qkv[64:80]),
            "v": Target((16, 48), out=qkv[80:96]),
            "gate": Target((48, 40), "float16", out=gate_up[:, :40]), "up": Target((48, 40), "float16",
                                                                                  out=gate_up[:, 41:]),
            "w": Target((48, 24), "float32", out=lambda: poisoned((24, 48), "float32"),
                        transform=lambda src, out: hf.convert(src.T, out))}
    got = load(tmp_path, plan, CupyDevice(), buffer_bytes=1000)
    b = {n: a.astype(ml_dtypes.bfloat16) for n, a in state.items()}
    assert same(qkv[:96], np.concatenate([b["q"], b["k"], b["v"]]))
    assert np.isnan(cupy.asnumpy(qkv[96]).astype(np.float32)).all()
    assert same(gate_up[:, :40], b["gate"].astype(np.float16)) and same(gate_up[:, 41:], b["up"].astype(np.float16))
    assert np.isnan(cupy.asnumpy(gate_up[:, 40])).all()
    assert same(got["w"], b["w"].T.astype(np.float32))


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_host_memory_is_the_staging_buffers(tmp_path):
    """A 512 MB checkpoint through four 16 MB buffers: peak resident memory rises by at most the buffers and a
    little (whether pinned pages count as resident depends on the driver), not the checkpoint; the buffers are
    freed afterwards."""
    shapes = {f"w{i}": (4096, 2048) for i in range(16)}           # 16 x 32 MB in float32, views of one pool
    pool = np.random.default_rng().standard_normal(4096 * 2048, np.float32)
    hf.write_checkpoint(tmp_path, {}, {n: pool.reshape(s) for n, s in shapes.items()})
    first = pool[:8].copy()
    del pool
    outs = {n: cupy.empty(s, cupy.float32) for n, s in shapes.items()}
    CupyDevice().staging(1)                                       # CUDA and the pinned allocator up before measuring
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:                 # reset VmHWM to the current VmRSS
        f.write("5")
    before = _rss_kb("VmRSS")
    load(tmp_path, {n: Target(s, "float32", out=outs[n]) for n, s in shapes.items()}, CupyDevice(),
         buffers=4, buffer_bytes=16 << 20)
    peak = _rss_kb("VmHWM") - before
    gc.collect()
    after = _rss_kb("VmRSS") - before
    assert peak < (64 + 100) << 10, peak                           # KiB: the staging buffers and a little
    assert after < 32 << 10, after
    assert (cupy.asnumpy(outs["w15"][0, :8]) == first).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_the_finite_check_flags_exactly_the_tensors_with_a_nonfinite_value(dtype):
    """CupyDevice.flag_nonfinite against HostDevice's, on fresh random values of every width, in 8-byte words (a
    contiguous, aligned array) and one value at a time (odd sizes, offset and strided views), a planted infinity or
    NaN at a random place in every other array (the flags start clear: only a set flag says anything)."""
    rng = np.random.default_rng()
    uint, bits = hf.stream.EXPONENT_BITS[dtype]
    mask = np.array(bits, uint)
    cases = []
    for n, view in [(4096, slice(None)), (4099, slice(None)), (4099, slice(1, None)), (4100, slice(None, None, 3)),
                    (8, slice(None)), (1, slice(None))] * 2:
        values = rng.integers(0, np.iinfo(uint).max, n, dtype=np.uint64).astype(uint) & ~mask
        if len(cases) % 2:
            values[rng.integers(0, n)] |= mask
        cases.append((values, view))
    bad = [bool(((values[view] & mask) == mask).any()) for values, view in cases]
    assert any(bad) and not all(bad)
    gpu, cpu = CupyDevice(), HostDevice()
    flags, expected = gpu.flags(len(cases)), cpu.flags(len(cases))
    for slot, (values, view) in enumerate(cases):
        gpu.flag_nonfinite(cupy.asarray(values)[view], dtype, flags, slot)
        cpu.flag_nonfinite(values[view], dtype, expected, slot)
    gpu.synchronize()
    assert gpu.read_flags(flags) == cpu.read_flags(expected) == bad

"""Where decode attention's time goes at short contexts: variants of its kernel (text edits of
tilekit/kernels/decode_attention.py's kernels, imported from a temporary module) against the kernel itself, over
every config its space admits (short contexts) or the tuned one, each output checked against float64 as the GPU
tests check (tilekit.kernels.checks: the whole output and every row; a row that fails gets no time).

    python -m benchmarks.studies.decode_attention_variants [OUT.json] [--against REV]

--against REV adds the kernel of git revision REV (its whole module, launched through its own op) as one more
variant: a kernel change measured against the one before it in the same run.

Time, two ways: `us`, LAYERS launches, each on its own arrays as a model's layers are, captured in a CUDA graph and
replayed after an L2 flush and a device synchronize (so each time holds the graph's submission too, a few us: under
0.5 us a launch), the median of 30 replays divided by LAYERS; `tuner_us`, one launch timed as the tuner
times it (tilekit.autotune.tuner.measure_launches: eager, L2 flushed, mean of 30). Produced
docs/results/decode-attention-short-h100.txt.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

da = importlib.import_module("tilekit.kernels.decode_attention")

LAYERS = 16
SHAPES = [  # B, H, Hkv, D, capacity, new_kv
    (1, 16, 4, 128, 256, 1), (1, 32, 8, 128, 256, 1), (8, 32, 8, 128, 256, 1), (1, 12, 12, 64, 256, 1),
    (1, 32, 8, 128, 1024, 1), (1, 32, 8, 128, 4096, 1), (1, 16, 4, 128, 256, 0),
]
K_LOAD = "k = cache_tile(K, Table, b, hk, j, BN, D, LATENCY, PAGED)"
HINTED_LOAD = ", latency=LATENCY)"
NEW_START = "    if NEW_KV:\n        if split == (length - 1) // CHUNK:"
LOOP_START = "    for j in range(start // BN, ct.cdiv(end, BN)):"
TAIL_START = "    if not MERGE:\n        out = acc / l_i"
V_START, V_END = "        # V's tile loaded after", "        m_i, l_i, acc = online_softmax_step_by_column"


def late_new(src: str) -> str:
    """The new tokens' fold after the cached positions' loop."""
    a, b, c = src.index(NEW_START), src.index(LOOP_START), src.index(TAIL_START)
    return src[:a] + src[b:c] + src[a:b] + src[c:]


def v_beside_k(src: str) -> str:
    """V's tile loaded right after K's, before the scores."""
    v = src[src.index(V_START):src.index(V_END)]
    src = src.replace(v, "")
    k_line = src[src.index(K_LOAD) - 8:src.index("\n", src.index(K_LOAD)) + 1]
    return src.replace(k_line, k_line + v)


NEW_TILE = """\
            r = ct.arange(MAX_QUERIES, dtype=ct.int32).reshape((MAX_QUERIES, 1))
            k_new = ct.load(Knew, (b, hk, 0, 0), (1, 1, MAX_QUERIES, D), padding_mode=ZERO).reshape((MAX_QUERIES, D))
            v_new = ct.load(Vnew, (b, hk, 0, 0), (1, 1, MAX_QUERIES, D), padding_mode=ZERO).reshape((MAX_QUERIES, D))
            k_write = k_new
            v_write = v_new
            if FP8:
                k_write = fp8_bits(k_new.astype(ct.float32), k_scale)
                v_write = fp8_bits(v_new.astype(ct.float32), v_scale)
                k_new = ct.bitcast(k_write, ct.float8_e4m3fn).astype(Q.dtype)
                v_new = ct.bitcast(v_write, ct.float8_e4m3fn).astype(Q.dtype)
"""
NEW_FOLD = """\
            s_new = ct.mma(k_new, q_t, ct.zeros((MAX_QUERIES, QP), dtype=ct.float32)) * score_scale
            s_new = ct.where((r < nq) & (r <= q_token), s_new, -math.inf)
            m_i, l_i, acc = online_softmax_step_by_column(s_new, m_i, l_i, acc, ct.transpose(v_new))
"""
NEW_WRITE = """\
            ct.scatter(K, (b, hk, first_new + r, dims), k_write, mask=r < nq)
            ct.scatter(V, (b, hk, first_new + r, dims), v_write, mask=r < nq)
"""
LAST_SPLIT = "    if NEW_KV:\n        if split == (length - 1) // CHUNK:\n"


def new_tile(src: str) -> str:
    """The new tokens as one tile of MAX_QUERIES keys (zeros past nq): one product and one softmax step where the
    kernel folds them in a token at a time, before the loop; their cache write after it (loaded again there)."""
    a, b, c = src.index(NEW_START), src.index(LOOP_START), src.index(TAIL_START)
    return src[:a] + LAST_SPLIT + NEW_TILE + NEW_FOLD + src[b:c] + LAST_SPLIT + NEW_TILE + NEW_WRITE + src[c:]


def new_tile_ahead(src: str) -> str:
    """As new_tile, the tile loaded before the loop by every split (its latency behind the loop's), folded and
    written after the loop by the split holding the last position."""
    a, b, c = src.index(NEW_START), src.index(LOOP_START), src.index(TAIL_START)
    ahead = "    if NEW_KV:\n" + NEW_TILE.replace("\n            ", "\n        ")[4:]
    return src[:a] + ahead + src[b:c] + LAST_SPLIT + NEW_FOLD + NEW_WRITE + src[c:]


def latency(n: int):
    """The K and V tiles loaded with latency hint n where the kernel hints them (occupancy 1); 0: no hint."""
    return lambda src: src.replace(HINTED_LOAD, f", latency={n})" if n else ")")


VARIANTS = {
    "kernel": lambda s: s,
    "no_hint": latency(0),
    "lat2": latency(2),
    "lat8": latency(8),
    "late_new": late_new,
    "v_beside_k": v_beside_k,
    "new_tile": new_tile,
    "new_tile_ahead": new_tile_ahead,
}


def imported(source: str, name: str, folder: str):
    """`source` imported as module `name` from a file in `folder` (cuTile reads kernels' source from files)."""
    path = Path(folder) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def variant_module(name: str, folder: str):
    """The kernels of decode_attention.py (the source up to its host code) with VARIANTS[name] applied."""
    source = Path(da.__file__).read_text()
    head = source[:source.index("MIN_CHUNK = 128")]
    edited = VARIANTS[name](head)
    if name != "kernel" and edited == head:
        raise RuntimeError(f"variant {name} no longer applies to decode_attention.py")
    return imported(edited, f"decode_variant_{name}", folder)


def revision_module(rev: str, folder: str):
    """decode_attention.py as git revision `rev` has it, whole (its op launches its kernels: their arguments may
    differ from this tree's)."""
    root = Path(__file__).resolve().parents[2]
    source = subprocess.run(["git", "show", f"{rev}:tilekit/kernels/decode_attention.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    return imported(source, "decode_revision_" + "".join(ch if ch.isalnum() else "_" for ch in rev), folder)


def problem(B, H, Hkv, D, capacity, new_kv) -> dict:
    return dict(dtype="bfloat16", B=B, H=H, Hkv=Hkv, nq=1, capacity=capacity, D=D, new_kv=new_kv, fp8=0)


def layer_arrays(p: dict) -> dict:
    """Fresh random arrays of one launch in the op's declared layout (lengths = capacity)."""
    import cupy

    from tilekit.autotune.arrays import bench_array
    rng = cupy.random.default_rng()
    values = {n: bench_array(s, 0, rng) for n, s in da.DECODE_ATTENTION.arrays(p).items()}
    return {**values, **da.DECODE_ATTENTION.scalars(p)}


KEEP = {}      # hinted kernels live as long as the process, as Op.hinted keeps them: one collected after it had
               # launched took the process down (a segmentation fault, session 33)


def launches(p: dict, c: dict, values: dict, module, warps: int | None) -> list:
    """(kernel, grid, args) of each launch of config c, the kernels taken from `module`, launched as its op (when
    it declares one; else this tree's) launches them."""
    import cupy

    from tilekit.autotune.arrays import bench_array
    op = getattr(module, "DECODE_ATTENTION", da.DECODE_ATTENTION)
    for n, s in op.scratch(p, c).items():
        values.setdefault((n, s), bench_array(s, 0, cupy.random.default_rng()))
        values[n] = values[(n, s)]
    out = []
    for launch in op.launches:
        grid = tuple(launch.grid(p, c))
        if 0 in grid:
            continue
        name = launch.kernel._pyfunc.__name__
        hints = {"occupancy": c["occupancy"], **({"num_worker_warps": warps} if warps else {})} if launch.hinted else {}
        key = (module.__name__, name, tuple(sorted(hints.items())))
        if key not in KEEP:
            kernel = getattr(module, name)
            KEEP[key] = kernel.replace_hints(**hints) if hints else kernel
        out.append((KEEP[key], grid, tuple(values[n] for n in launch.args) + tuple(launch.constants(p, c))))
    return out


def checked_errors(p: dict, c: dict, values: dict, module, warps) -> tuple[float, float]:
    """(relative error of the whole output, of its worst row) of one launch's output (poisoned first) against
    float64, as tilekit.kernels.checks measures them."""
    import cupy
    import cuda.tile as ct

    from tilekit.kernels.checks import NAN_BITS, host, rel_err, row_errors
    uint, bits = NAN_BITS[p["dtype"]]
    values["o"].view(uint).fill(bits)
    k, v = host(values["k"]), host(values["v"])
    stream = cupy.cuda.get_current_stream()
    for kernel, grid, args in launches(p, c, values, module, warps):
        ct.launch(stream, grid, kernel, args)
    stream.synchronize()
    new = dict(new_k=host(values["k_new"]), new_v=host(values["v_new"])) if p["new_kv"] else {}
    ref = da.decode_attention_reference(host(values["q"]), k, v, cupy.asnumpy(values["lengths"]), **new)
    got = host(values["o"])
    return rel_err(got, ref), float(row_errors(got, ref).max())


def passed(row: dict) -> bool:
    """The output check of tilekit.kernels.checks.assert_close: the whole output and every row within bounds."""
    from tilekit.kernels.checks import ROW_SLACK, TOL
    tol = TOL[row["dtype"]]
    return row["error"] < tol and row["worst_row"] < ROW_SLACK * tol


def replayed_us(recipes: list, stream, flush) -> float:
    import cupy
    import cuda.tile as ct
    for recipe in recipes:                  # compiled and loaded before the capture
        for kernel, grid, args in recipe:
            ct.launch(stream, grid, kernel, args)
    stream.synchronize()
    stream.begin_capture()
    for recipe in recipes:
        for kernel, grid, args in recipe:
            ct.launch(stream, grid, kernel, args)
    graph = stream.end_capture()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(33):
        with stream:
            flush.fill(i)
        cupy.cuda.Device().synchronize()    # the flush done before the clock starts (session 34's runs timed it too)
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        if i >= 3:
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / len(recipes))
    return statistics.median(times)


def main(argv: list[str]) -> int:
    import argparse

    import cupy

    from tilekit.autotune.tuner import measure_launches
    from tilekit.device import device_info
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="JSON file for the rows")
    parser.add_argument("--against", metavar="REV", help="also the kernel of this git revision")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp()
    modules = {name: variant_module(name, folder) for name in VARIANTS}
    modules["package"] = da         # the kernels as imported from tilekit (the copy above runs from a temporary file)
    if args.against:
        modules[f"at {args.against}"] = revision_module(args.against, folder)
    # the configs: the shipped ones, which are tuned for the revision's kernel where one is given
    chooser = getattr(modules.get(f"at {args.against}"), "DECODE_ATTENTION", da.DECODE_ATTENTION)
    stream = cupy.cuda.Stream(non_blocking=True)
    flush = cupy.empty(64 << 20, cupy.int32)
    rows = []
    for shape in SHAPES:
        p = problem(*shape)
        tuned = chooser.resolve(p, device_info(0), mode="cached").config
        configs = da.SPACE.candidates(dict(p)) if shape[4] <= 256 and shape[5] else [tuned]
        plans = [("kernel", c, None) for c in configs] + [(v, tuned, None) for v in modules if v != "kernel"]
        plans.append(("kernel", tuned, 8))
        layers = [layer_arrays(p) for _ in range(LAYERS)]
        for variant, c, warps in plans:
            row = dict(shape=shape, dtype=p["dtype"], variant=variant + ("+8 warps" if warps else ""), config=c,
                       tuned=c == tuned)
            try:
                row["error"], row["worst_row"] = checked_errors(p, c, layers[0], modules[variant], warps)
                with stream:                        # measure_launches flushes L2 on the current stream
                    row["tuner_us"] = measure_launches([c], stream, lambda _: launches(
                        p, c, layers[0], modules[variant], warps)).best.mean_us
                row["us"] = replayed_us([launches(p, c, values, modules[variant], warps) for values in layers],
                                        stream, flush)
            except Exception as e:  # noqa: BLE001  (a variant that fails is a row saying so)
                row["failure"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{'B, H, Hkv, D, capacity, new_kv':28s} {'variant':16s} config  (* tuned)   us/launch  tuner_us  error (worst row)")
    for r in rows:
        c = r["config"]
        label = f"{'*' if r['tuned'] else ' '} BN{c['BN']:<4d} P{c['PROGRAMS']:<5d} occ{c['occupancy']}"
        if "failure" in r:
            result = r["failure"]
        else:
            errors = f"{r['error']:.1e} ({r['worst_row']:.1e})"
            result = f"{r['us']:8.2f}  {r['tuner_us']:8.2f}   {errors}" if passed(r) else f"  FAILED   {errors}"
        print(f"{str(r['shape']):28s} {r['variant']:16s} {label}  {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

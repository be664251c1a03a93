"""Host cost of eager tilekit calls, GPU work excluded: `python -m benchmarks --only overhead`, or on
its own against any tilekit checkout with the same public functions (before / after a change):

    python -m benchmarks.suites.overhead [--tilekit CHECKOUT] [--out DIR] [--calls N]

imports tilekit from CHECKOUT (default: whichever is importable) and writes DIR/overhead.json.
Rows: linear, layer_norm and attention on tiny problems, with torch tensors and with CuPy arrays,
with `out=` and without: the median host time of one call over `calls` calls, beside the torch op
on the same tensors; the first call after tilekit.autotune.store.reset() (plans forgotten, kernels
compiled); and a bare ct.launch of a one-array cuTile kernel, the floor. Only the public kernel
functions and store.reset() are used.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import cuda.tile as ct
import numpy as np

from benchmarks.harness import checks, report, system, timing
from benchmarks.harness.log import Log
from benchmarks.harness.report import Row, fill_times, short_error

CALLS = 1000
FIRST_CALL_REPS = 20
KINDS = ("torch", "cupy")


@ct.kernel
def touch_kernel(X):
    """X[:16] += 1: about the least a cuTile kernel can do."""
    ct.store(X, (0,), ct.load(X, (0,), (16,)) + 1.0)


@dataclass
class Case:
    op: str
    shape: str
    anchor: str                                  # the torch op timed beside tilekit's torch rows
    reference: Callable                          # () -> the torch op's output
    call: Callable                               # (kind, with_out) -> a () -> output callable


def cases() -> list[Case]:
    """linear (16x64 @ 64x64 + b), layer_norm (16x64), causal attention (1x1x64x64), bf16 random data;
    the torch and CuPy inputs hold the same values."""
    import cupy
    import ml_dtypes
    import torch
    import torch.nn.functional as F
    import tilekit.kernels as tk
    rng = np.random.default_rng(0)

    def inputs(*shapes):
        host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        return {"torch": [torch.from_numpy(h).to("cuda", torch.bfloat16) for h in host],
                "cupy": [cupy.asarray(h.astype(ml_dtypes.bfloat16)) for h in host]}

    def calls(fn, arrays, out_shape):
        def call(kind, with_out):
            args = arrays[kind]
            if not with_out:
                return lambda: fn(*args)
            out = (torch.empty(out_shape, dtype=torch.bfloat16, device="cuda") if kind == "torch"
                   else cupy.empty(out_shape, dtype=ml_dtypes.bfloat16))
            return lambda: fn(*args, out=out)
        return call

    lin = inputs((16, 64), (64, 64), (64,))
    x, w, b = lin["torch"]
    ln = inputs((16, 64), (64,), (64,))
    lx, lw, lb = ln["torch"]
    att = inputs(*[(1, 1, 64, 64)] * 3)
    q, k, v = att["torch"]
    return [Case("linear", "x 16x64, W 64x64, bias", "torch.addmm", lambda: torch.addmm(b, x, w),
                 calls(lambda x, w, b, **kw: tk.linear(x, w, b, **kw), lin, (16, 64))),
            Case("layer_norm", "16x64", "F.layer_norm", lambda: F.layer_norm(lx, (64,), lw, lb, 1e-5),
                 calls(lambda x, w, b, **kw: tk.layer_norm(x, w, b, 1e-5, **kw), ln, (16, 64))),
            Case("attention", "causal B1 H1 T64 D64", "F.sdpa",
                 lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 calls(lambda q, k, v, **kw: tk.attention(q, k, v, causal=True, **kw), att, (1, 1, 64, 64)))]


def launch_floor() -> Callable:
    """A bare ct.launch of touch_kernel on a 16-float CuPy array, on CuPy's current stream."""
    import cupy
    x = cupy.zeros(16, dtype=cupy.float32)
    return lambda: ct.launch(cupy.cuda.get_current_stream(), (1, 1, 1), touch_kernel, (x,))


def reset_plans() -> None:
    from tilekit.autotune import store
    store.reset()


def first_call_time(fn, reps: int = FIRST_CALL_REPS) -> dict:
    """Host time (ms) of fn() right after reset_plans(), each of `reps` times after a synchronize."""
    times = []
    for _ in range(reps):
        timing.synchronize()
        reset_plans()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e6)
    timing.synchronize()
    return timing.summarize(times)


def _row(label: str, shape: str, anchor: str = "-", **params) -> Row:
    return Row(suite="overhead", name=label.split()[0], label=label, shape=shape, anchor=anchor,
               tolerance=checks.TOLERANCE["bfloat16"], params=params)


def run(mode: str = "quick", log=print, calls: int = CALLS) -> list[Row]:
    """Every row of the suite (the same in quick and full mode)."""
    rows = []
    for case in cases():
        log(f"[overhead] {case.op}: {calls} eager calls per row")
        reference = case.reference()
        anchor_time = timing.host_time(case.reference, calls=calls)
        for kind in KINDS:
            for with_out in (False, True):
                r = _row(f"{case.op} {kind}" + (" out=" if with_out else ""), case.shape,
                         case.anchor if kind == "torch" else "-", kind=kind, out=with_out, calls=calls)
                rows.append(r)
                try:
                    fn = case.call(kind, with_out)
                    r.error = checks.rel_error(fn(), reference)
                    if not r.error < r.tolerance:
                        r.status, r.note = "failed", f"relative error {r.error:.3g} >= tolerance {r.tolerance:g}"
                        continue
                    fill_times(r, timing.host_time(fn, calls=calls), anchor_time if kind == "torch" else None)
                except Exception as e:  # noqa: BLE001
                    r.status, r.note = "error", short_error(e)
        r = _row(f"{case.op} first call", case.shape, kind="torch", reps=FIRST_CALL_REPS)
        rows.append(r)
        try:
            fn = case.call("torch", False)
            r.error = checks.rel_error(fn(), reference)
            fill_times(r, first_call_time(fn), None)
            r.note = "one call after tilekit.autotune.store.reset(), kernels compiled"
        except Exception as e:  # noqa: BLE001
            r.status, r.note = "error", short_error(e)
    r = _row("ct.launch floor", "one-array kernel, grid 1", calls=calls)
    rows.append(r)
    try:
        fill_times(r, timing.host_time(launch_floor(), calls=calls), None)
    except Exception as e:  # noqa: BLE001
        r.status, r.note = "error", short_error(e)
    for r in rows:
        log(f"    {r.label}: " + (f"{r.tilekit_ms * 1e3:.1f} us" if r.status == "ok" else f"{r.status}: {r.note}"))
    return rows


def tilekit_source() -> dict:
    """Where the imported tilekit lives and its checkout's git commit (None outside a git checkout)."""
    import tilekit
    where = Path(tilekit.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"path": str(where), "commit": commit}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.suites.overhead",
                                 description="host time per eager tilekit call; writes DIR/overhead.json")
    ap.add_argument("--tilekit", type=Path, metavar="CHECKOUT", help="import tilekit from this checkout")
    ap.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR")
    ap.add_argument("--calls", type=int, default=CALLS, help=f"eager calls per row (default {CALLS})")
    args = ap.parse_args(argv)
    if args.tilekit is not None:
        sys.path.insert(0, str(args.tilekit.resolve()))
    log = Log()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": "overhead", "argv": argv, "gpu": system.gpu_identity(), "versions": system.versions(),
            "tilekit": tilekit_source()}
    rows = run(log=log, calls=args.calls)
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(args.out / "overhead.json", meta, rows)
    print(report.format_table(rows, meta), flush=True)
    return report.exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())

"""How a process that ran a model ends (issue #59): each way of ending in a fresh subprocess, its exit status and
whether stderr holds "Fatal Python error". The "unhooked" variants take tilekit.engine.lifecycle's atexit handler
away again (the shutdown of the code before it) and release one kind of object by hand, to isolate which objects
alive at interpreter shutdown make it crash.

    python diag/exit_paths.py [--model DIR] [--out DIR] [--backtrace]

--backtrace also runs the unhooked script under cuda-gdb (batch mode) and keeps its native backtrace.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROLOGUE = """
import atexit, gc, os, signal, sys, threading
import numpy as np
from tilekit.autotune import arrays, store
from tilekit.engine import lifecycle
from tilekit.models import load_model
model = load_model({model!r}, dtype={dtype!r})
ids = np.arange(1, 9, dtype=np.int64)[None] % model.config.vocab_size
"""

ENDINGS = {
    "load-only": "",
    "forward": "print(float(model(ids).astype('float32').sum()))",
    "forward-eager": "print(float(model(ids, use_graph=False).astype('float32').sum()))",
    "generate": "print(model.generate(ids, 8)[0][-3:])",
    "generate-sampled": "print(model.generate(ids, 8, temperature=0.8, top_k=20, seed=1)[0][-3:])",
    "generate-eager": "print(model.generate(ids, 8, use_graph=False)[0][-3:])",
    "sys-exit": "model.generate(ids, 8); sys.exit(0)",
    "exception": "model.generate(ids, 8); raise RuntimeError('escaping')",
    "two-models": "other = load_model({model!r}, dtype={dtype!r}); model.generate(ids, 8); other.generate(ids, 8)",
    "forget-graphs": "model.generate(ids, 8); model(ids); model.forget_graphs()",
    "del-gc": "model.generate(ids, 8); model(ids); del model; gc.collect()",
    "store-reset": "model.generate(ids, 8); from tilekit.autotune import store; store.reset()",
    "thread": "t = threading.Thread(target=lambda: model.generate(ids, 8)); t.start(); t.join()",
    "unhooked": "model.generate(ids, 8); model(ids); atexit.unregister(lifecycle.release_all)",
    "unhooked-forget-graphs": "model.generate(ids, 8); model(ids); model.forget_graphs(); "
                              "atexit.unregister(lifecycle.release_all)",
    "unhooked-store-reset": "model.generate(ids, 8); model(ids); store.reset(); atexit.unregister(lifecycle.release_all)",
    "unhooked-scratch": "model.generate(ids, 8); model(ids); arrays.release_all_scratch(); "
                        "atexit.unregister(lifecycle.release_all)",
    "sigint-in-decode": textwrap.dedent("""
        import time
        def interrupt(tokens):
            if not hasattr(interrupt, 'n'):
                interrupt.n = 0
            interrupt.n += 1
            if interrupt.n == 3:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)
        try:
            model.generate(ids, 32, on_token=interrupt)
        except KeyboardInterrupt:
            print('interrupted')
        print(model.generate(ids, 8)[0][-3:])
        """),
}


SCRIPTS = Path(tempfile.mkdtemp(prefix="exit-paths-"))


def run(name: str, code: str, env: dict, out: Path, timeout: float = 240) -> tuple[int, bool]:
    """Run one ending's script; its status and output are appended to out/exit-paths.log."""
    script = SCRIPTS / f"exit-{name}.py"
    script.write_text(code)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=timeout)
    with open(out / "exit-paths.log", "a") as log:
        log.write(f"=== {name}: rc {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-4000:]}\n")
    return p.returncode, "Fatal Python error" in p.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "tests/data/tiny-gpt2"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/exit-paths"))
    ap.add_argument("--backtrace", action="store_true")
    ap.add_argument("--only", help="comma-separated endings")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    prologue = PROLOGUE.format(model=args.model, dtype=args.dtype)
    rows = []
    for name, ending in ENDINGS.items():
        if args.only and name not in args.only.split(","):
            continue
        rc, fatal = run(name, prologue + ending.format(model=args.model, dtype=args.dtype) + "\n", env, out)
        rows.append((name, rc, fatal))
        print(f"{name:18s} rc {rc:4d} {'FATAL' if fatal else ''}", flush=True)
    if args.backtrace:
        script = SCRIPTS / "exit-unhooked.py"
        gdb = subprocess.run(["cuda-gdb", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40",
                              "-ex", "info sharedlibrary", "--args", sys.executable, str(script)],
                             capture_output=True, text=True, env=env, timeout=300)
        (out / "exit-backtrace.txt").write_text(gdb.stdout + "\n--- stderr\n" + gdb.stderr)
        frames = [line for line in gdb.stdout.splitlines() if line.startswith("#")]
        print("backtrace:\n  " + "\n  ".join(frames[:25]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

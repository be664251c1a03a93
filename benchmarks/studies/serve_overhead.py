"""What tilekit serve itself costs per token, without a GPU: the server's HTTP, streaming and engine loop around a
stand-in executor whose every step takes a fixed time (a sleep: the GIL released, as a GPU wait releases it) and
picks a random token for each request. With the executor's time fixed, TPOT above it is the host's: the engine's
step bookkeeping and detokenizing, the hand-off to the event loop, the server-sent events, and the two threads'
turns at the GIL.

    python -m benchmarks.studies.serve_overhead [--step-ms 7] [--concurrency 64] [--num-prompts 128]
        [--output 128] [--switch-interval-ms 5 --switch-interval-ms 0.5 ...] [--out FILE]

The checkpoint is a one-layer GPT-2 of random weights with a byte-level BPE tokenizer trained here (8192 ids); the
client is benchmarks.serve in its own process (token-id prompts of 16-64 tokens, eos ignored). Each
--switch-interval-ms (default: Python's own 5 ms, then 0.5) runs the same requests on a new server with the
interpreter's switch interval set so (sys.setswitchinterval: how long a thread holding the GIL keeps it while
another waits).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

VOCAB = 8192


class FixedStepExecutor:
    """An executor whose steps take `seconds` from their launch (a GPU that runs while the host goes on: collect()
    sleeps until then) and pick a random token for every request picked."""

    def __init__(self, seconds: float, vocab: int):
        self.seconds, self.vocab, self.rng = seconds, vocab, np.random.default_rng(0)

    def launch(self, step, constraints=None):
        picks = {request.id: int(t) for request, t in zip(step.picks, self.rng.integers(1, self.vocab, len(step.picks)))}
        return time.perf_counter() + self.seconds, picks

    def collect(self, handle) -> dict:
        ready, picks = handle
        time.sleep(max(0.0, ready - time.perf_counter()))
        return picks

    def forget(self, request) -> None:
        pass

    def prepare_masks(self, constraints) -> None:
        pass

    def release(self) -> None:
        pass


def write_checkpoint(directory: Path) -> None:
    """A one-layer GPT-2 of random weights (context 4096) and a trained 8192-id tokenizer, unless written already."""
    if (directory / "tokenizer.json").is_file():
        return
    import dataclasses

    from benchmarks.studies.structured import train_tokenizer
    from tilekit.models import families
    config = dataclasses.replace(families.preset_config("gpt2"), n_layer=1, n_head=2, n_embd=16, block_size=4096,
                                 vocab_size=VOCAB, eos_token_id=0, bos_token_id=0)
    weights = families.family_of_config(config).module("weights")
    weights.save_state_dict(directory, config, weights.random_state_dict(config, 0))
    train_tokenizer(VOCAB).save(str(directory / "tokenizer.json"))


def serve_once(checkpoint: Path, args, switch_s: float) -> dict:
    """One server (a fresh engine) with the switch interval `switch_s`; the client's summary of the requests."""
    import socket

    import uvicorn

    from tilekit.engine.llm import AsyncEngine, LLMEngine
    from tilekit.models.families import load_reference
    from tilekit.serve.app import Server, build_app
    llm = LLMEngine(load_reference(checkpoint), max_running=args.concurrency, token_budget=4096, block=16)
    llm.executor = FixedStepExecutor(args.step_ms / 1e3, VOCAB)
    engine = AsyncEngine(llm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(build_app(Server(engine, "tiny")), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    thread.start()
    try:
        while not uv.started:
            time.sleep(0.05)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "serve.json"
            subprocess.run([sys.executable, "-m", "benchmarks.serve", "--base-url", f"http://127.0.0.1:{port}",
                            "--model", "tiny", "--num-prompts", str(args.num_prompts), "--input-len", "16", "64",
                            "--output-len", str(args.output), str(args.output), "--max-concurrency",
                            str(args.concurrency), "--vocab-size", str(VOCAB), "--out", str(out)],
                           check=True, capture_output=True, text=True, timeout=1800)
            return json.loads(out.read_text())
    finally:
        uv.should_exit = True
        thread.join(30)
        engine.shutdown(timeout=10)
        sys.setswitchinterval(previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.serve_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=7.0, help="each step's time (default 7 ms)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output", type=int, default=128, help="tokens per request")
    parser.add_argument("--switch-interval-ms", type=float, action="append", dest="switch",
                        help="the interpreter's switch interval for one run (repeatable; default 5 and 0.5)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tilekit-serve-overhead"))
    parser.add_argument("--out", type=Path, help="JSON file for the rows")
    args = parser.parse_args(argv)
    bad = [name for name, v in (("--step-ms", args.step_ms), ("--concurrency", args.concurrency),
                                ("--num-prompts", args.num_prompts), ("--output", args.output - 1),
                                *(("--switch-interval-ms", s) for s in args.switch or ())) if not v > 0]
    if bad:
        parser.error(f"{', '.join(bad)} must be positive (--output at least 2)")
    write_checkpoint(args.work / "tiny-gpt2")
    rows = []
    ideal = args.concurrency / (args.step_ms / 1e3)
    print(f"stand-in steps of {args.step_ms} ms, {args.num_prompts} requests of {args.output} tokens at concurrency "
          f"{args.concurrency}: at most {ideal:.0f} output tok/s")
    for switch_ms in args.switch or (5.0, 0.5):
        summary = serve_once(args.work / "tiny-gpt2", args, switch_ms / 1e3)
        tpot = summary["tpot_ms"]["median"]
        rows.append(dict(switch_interval_ms=switch_ms, step_ms=args.step_ms, **summary))
        print(f"  switch interval {switch_ms:4.1f} ms: {summary['completed']} ok, {summary['failed']} failed; "
              f"{summary['output_throughput']:7.0f} output tok/s ({summary['output_throughput'] / ideal:4.0%} of the "
              f"steps' rate); TPOT median {tpot:6.2f} ms ({tpot - args.step_ms:+.2f} ms over the step), ITL p99 "
              f"{summary['itl_ms']['p99']:.2f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(argv=sys.argv, rows=rows), indent=1))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

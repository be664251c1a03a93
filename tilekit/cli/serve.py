"""`tilekit serve`: an OpenAI-compatible HTTP server (tilekit.serve) for a checkpoint of any dense family, on the
continuous-batching engine (one GPU), or on the NumPy reference with --device cpu (slow; for trying it out and
for tests). Binds 127.0.0.1 unless told otherwise; SIGTERM or Ctrl-C stops admitting, lets the running requests
finish (up to --shutdown-timeout seconds, then aborts them) and exits 0."""

from __future__ import annotations

import contextlib
import signal
import sys

from tilekit.cli.common import UsageError, _count, _dtype, _positive
from tilekit.untrusted import shown


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API")
    p.add_argument("--model", required=True, help="checkpoint directory or HF cache name")
    p.add_argument("--served-model-name", help="the name clients send as `model` (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=_count, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every endpoint but /health (default: "
                                     "TILEKIT_API_KEY; prefer it: a command line is visible to other users)")
    p.add_argument("--dtype", type=_dtype, default="bfloat16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--quantize", choices=("int8", "fp8"), help="quantize the linears per channel as they load")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="the KV cache's blocks")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the engine on tilekit's kernels; cpu: the NumPy reference, slowly")
    p.add_argument("--max-running", type=_positive, default=64, help="requests running at once (default 64)")
    p.add_argument("--max-waiting", type=_positive, default=256,
                   help="requests waiting beyond those; more are answered 503 (default 256)")
    p.add_argument("--token-budget", type=_positive, default=2048, help="tokens one step computes (default 2048)")
    p.add_argument("--max-len", type=_positive, help="a request's prompt + max_tokens (default: the model's context)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the free GPU memory the KV cache takes (default 0.9)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on shutdown (default 30)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                   help="uvicorn's log level (default info; debug adds the access log)")


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM or SIGINT it shut down for gracefully is not raised again after
        (uvicorn re-raises it, so the process would end by the signal: status -15, not 0)."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
    return Server


def run(args) -> int:
    import importlib.util
    missing = [m for m in ("starlette", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"tilekit serve needs the serve extra (pip install \"tilekit[serve]\"): {', '.join(missing)} "
                         "missing")
    import uvicorn
    from tilekit import env
    api_key = args.api_key if args.api_key is not None else env.api_key()
    if api_key is not None and (not api_key or len(api_key) > 512 or not api_key.isprintable()
                                or any(c.isspace() for c in api_key)):
        raise UsageError("--api-key must be 1 to 512 printable characters without blanks")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must lie in (0, 1], got {args.gpu_memory_utilization}")
    if args.port > 65535:
        raise UsageError(f"--port must be at most 65535, got {args.port}")
    from tilekit.cli.generate import _load
    args.quantize_head = False
    args.command = "serve"
    model = _load(args)
    if args.device == "cuda":
        print("tilekit: starting the engine: every step shape is compiled and the decode steps captured now (minutes on "
              "a cold kernel cache, seconds once cached)", file=sys.stderr, flush=True)
    from tilekit.engine.llm import AsyncEngine, LLMEngine
    engine = AsyncEngine(LLMEngine(model, max_running=args.max_running, token_budget=args.token_budget,
                                   max_len=args.max_len, gpu_memory_utilization=args.gpu_memory_utilization,
                                   kv_cache_dtype=args.kv_cache_dtype, prefix_caching=not args.no_prefix_caching))
    startup = getattr(engine.engine.executor, "startup", None)        # the GPU engine's start-up phases
    if startup:
        left = startup["precompile_errors"]
        print(f"tilekit: engine started: {startup['launches'] - len(left)} kernels compiled ahead in "
              f"{startup['precompile_s']:.0f} s, the steps run and captured in {startup['run_s']:.0f} s",
              file=sys.stderr, flush=True)
        for line in left[:5]:
            print(f"tilekit: not compiled ahead (compiled as it first ran): {shown(line, 300)}", file=sys.stderr)
        if len(left) > 5:
            print(f"tilekit: and {len(left) - 5} more not compiled ahead", file=sys.stderr, flush=True)
    from tilekit.serve.app import Server, build_app

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown(timeout=args.shutdown_timeout)

    server = Server(engine, args.served_model_name or args.model, api_key=api_key, max_waiting=args.max_waiting)
    config = uvicorn.Config(build_app(server, lifespan), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.log_level == "debug")
    print(f"tilekit: serving {server.model_name!r} on http://{args.host}:{args.port} (max_len {server.max_len}, "
          f"{engine.engine.pool.num_blocks - 1} KV blocks of {engine.engine.pool.block})", file=sys.stderr, flush=True)
    _server_class()(config).run()
    if engine.thread.is_alive():
        engine.shutdown(timeout=0)
    return 0

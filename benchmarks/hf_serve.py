"""transformers' own continuous batching behind the endpoint that benchmarks.serve drives: the serving benchmark's
anchor.

    python -m benchmarks.hf_serve --model DIR [--port 8012] [--dtype bfloat16]

`transformers serve --continuous-batching` speaks the chat API in text and needs fastapi, which the GPU hosts do not
have. This serves the checkpoint's transformers model (from_pretrained onto the GPU, paged attention where this
transformers builds it) through its ContinuousBatchingManager. It takes token-id prompts on /v1/completions and
streams server-sent events with usage, the way benchmarks.serve sends them: greedy, eos off. One thread reads the
manager's outputs and routes each one to its request's stream; the manager's own per-request iterator re-queues
every other request's outputs, which costs the anchor time that the model does not. A client that goes away cancels
its request.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import threading
from types import SimpleNamespace

from benchmarks.studies.continuous import with_paged_attention

class Router:
    """The one reader of a manager's outputs: each goes to the asyncio queue of its request's stream."""

    def __init__(self, manager):
        self.manager = manager
        self.streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hf-serve-router", daemon=True)

    def open(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            self.streams[request_id] = (queue, asyncio.get_running_loop())
        return queue

    def close(self, request_id: str) -> None:
        with self.lock:
            self.streams.pop(request_id, None)

    def _run(self) -> None:
        while not self.stopping.is_set():
            out = self.manager.get_result(timeout=0.1)
            if out is None:
                if not getattr(self.manager, "is_running", lambda: True)():     # its generation loop ended
                    self._fail_all("transformers' generation loop stopped")
                continue
            self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, out) -> None:
        with self.lock:
            target = self.streams.get(request_id)
        if target is not None:
            queue, loop = target
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail_all(self, why: str) -> None:
        with self.lock:
            open_ids = list(self.streams)
        for request_id in open_ids:
            self._deliver(request_id, SimpleNamespace(request_id=request_id, error=why, status=None))


def failed(out) -> str | None:
    """Why the manager failed a request, or None."""
    if getattr(out, "error", None):
        return str(out.error)
    return "the request failed" if getattr(out.status, "name", "") == "FAILED" else None


def build_app(manager, router: Router):
    """A Starlette app: GET /health, POST /v1/completions (token-id prompt, max_tokens, stream)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    counter = itertools.count()

    def error(status: int, message: str):
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def completions(request):
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        prompt, n = body.get("prompt"), body.get("max_tokens")
        if not (isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt)):
            return error(400, "prompt must be a non-empty list of token ids (this anchor takes no text)")
        if type(n) is not int or n < 1:
            return error(400, f"max_tokens must be a positive integer, got {n!r}")
        request_id = f"bench-{next(counter)}"
        queue = router.open(request_id)
        try:
            manager.add_request(prompt, request_id=request_id, max_new_tokens=n, streaming=True)
        except Exception as e:  # noqa: BLE001 - a full input queue, a prompt the model refuses: this request fails
            router.close(request_id)
            return error(503, f"transformers refused the request: {type(e).__name__}: {e}")

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def stream():
            sent, done = 0, False
            try:
                while not done:
                    out = await queue.get()
                    why = failed(out)
                    if why:
                        yield event({"error": {"message": why, "type": "server_error"}})
                        done = True
                        break
                    tokens = list(out.generated_tokens)              # every token so far
                    done = out.is_finished()
                    if len(tokens) > sent:
                        yield event({"id": request_id, "object": "text_completion", "choices": [
                            {"index": 0, "text": "", "token_ids": tokens[sent:],
                             "finish_reason": "length" if done else None}]})
                        sent = len(tokens)
                yield event({"id": request_id, "object": "text_completion", "choices": [],
                             "usage": {"prompt_tokens": len(prompt), "completion_tokens": sent,
                                       "total_tokens": len(prompt) + sent}})
                yield "data: [DONE]\n\n"
            finally:
                router.close(request_id)
                if not done:
                    manager.cancel_request(request_id)

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])


def load_manager(directory: str, dtype: str):
    """The checkpoint's transformers model on the GPU and its started continuous-batching manager (greedy, eos off),
    with the attention implementation it was loaded with."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation import GenerationConfig
    model, impl = with_paged_attention(lambda impl: AutoModelForCausalLM.from_pretrained(
        directory, dtype=getattr(torch, dtype), device_map="cuda", attn_implementation=impl))
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=128)
    manager = model.init_continuous_batching(generation_config=config)
    if hasattr(manager, "warmup"):          # its CUDA graphs captured before the clock, as generate_batch does
        manager.warmup()
    manager.start()
    return manager, impl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the checkpoint directory tilekit serve serves")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8012)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = p.parse_args(argv)
    import uvicorn
    manager, impl = load_manager(args.model, args.dtype)
    router = Router(manager)
    router.thread.start()
    print(f"hf_serve: transformers continuous batching ({impl}) on http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)
    try:
        uvicorn.run(build_app(manager, router), host=args.host, port=args.port, log_level="warning")
    finally:
        router.stopping.set()
        manager.stop(block=True, timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

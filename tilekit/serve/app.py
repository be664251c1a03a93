"""The OpenAI-compatible HTTP API over an AsyncEngine, as a Starlette application.

    /v1/chat/completions   the checkpoint's chat template, streamed (server-sent events) or not
    /v1/completions        a string, a list of strings, token ids or a list of them
    /v1/models             the served model
    /health                200 while the engine runs (never needs the API key)
    /metrics               Prometheus text (tilekit.serve.metrics)

The engine steps in a thread of its own (AsyncEngine); this event loop only parses, tokenizes (in worker threads)
and writes. A request whose client disconnects is aborted and its KV blocks go back; a full waiting queue answers
503 with Retry-After; bodies past max_body bytes are 413; every bad field is a 400 naming it (protocol.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tilekit.serve.metrics import Metrics
from tilekit.serve.protocol import APIError, envelope, new_id, parse_json, parse_messages, parse_prompts, \
    parse_sampling, usage

MAX_BODY = 4 << 20
_SLOT = "\0"        # where a stream chunk's choice goes in its serialized envelope


class _Choice:
    """One generated choice: its engine request and output stream, what it has made, and its timings."""

    def __init__(self, index: int, request, outputs, arrived: float):
        self.index, self.request, self.outputs, self.arrived = index, request, outputs, arrived
        self.text, self.finish_reason, self.completion_tokens, self.cached_tokens = "", None, 0, 0
        self.last = None

    def took(self, out, metrics: Metrics) -> None:
        now = time.monotonic()
        if self.last is None:
            metrics.ttft.observe(now - self.arrived)
        else:                   # several tokens in one output (the stream fell behind): the gap shared among them
            for _ in out.token_ids:
                metrics.itl.observe((now - self.last) / len(out.token_ids))
        self.last = now
        self.text += out.text
        self.completion_tokens, self.cached_tokens = out.completion_tokens, out.cached_tokens
        metrics.generation_tokens.inc(len(out.token_ids))
        if out.finished:
            self.finish_reason = out.finish_reason
            metrics.e2e.observe(now - self.arrived)
            metrics.prompt_tokens.inc(out.prompt_tokens)
            metrics.finished.labels(metrics.model, out.finish_reason).inc()
        if self.request.started is not None and self.completion_tokens == len(out.token_ids):
            metrics.queue.observe(max(0.0, self.request.started - self.arrived))


class Server:
    """What the routes share: the engine, the served model's name and limits, the API key and the metrics."""

    def __init__(self, engine, model_name: str, *, api_key: str | None = None, max_waiting: int = 256,
                 max_body: int = MAX_BODY):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.max_waiting, self.max_body = max_waiting, max_body
        llm = engine.engine
        self.runner, self.max_len, self.vocab = llm.runner, llm.max_len, llm.model.config.vocab_size
        self.metrics = Metrics(self._stats, model_name)
        self.created = int(time.time())

    def _stats(self) -> dict:
        s = dict(self.engine.stats())
        s["waiting"] = self.engine.queue_depth
        return s

    # -- requests in ----------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key")

    async def body(self, request: Request) -> dict:
        self.authorize(request)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise APIError(413, f"the request body is over {self.max_body} bytes")
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > self.max_body:
                raise APIError(413, f"the request body is over {self.max_body} bytes")
        body = parse_json(bytes(raw))
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {json.dumps(model)[:100]} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        return body

    async def encode(self, prompt) -> list[int]:
        """Token ids of a prompt (ids pass through), tokenized in a worker thread."""
        if isinstance(prompt, list):
            return prompt
        try:
            return await asyncio.to_thread(self.runner._encoded, prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

    async def encode_chat(self, messages: list[dict]) -> list[int]:
        try:
            return await asyncio.to_thread(self.runner._chat_ids, messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    # -- generation -----------------------------------------------------------------------------
    async def submit(self, prompts: list[list[int]], sampling) -> list[_Choice]:
        """Every (prompt, choice) queued, after the context and the queue's room are checked."""
        for ids in prompts:
            if not ids:
                raise APIError(400, "the prompt encodes to no tokens", param="prompt")
            wanted = sampling.max_tokens if sampling.max_tokens is not None else self.max_len - len(ids)
            if len(ids) + max(wanted, 1) > self.max_len:
                raise APIError(400, f"this model's context is {self.max_len} tokens; the prompt has {len(ids)} tokens "
                                    f"and max_tokens is {wanted}: together they exceed it", param="max_tokens")
        count = len(prompts) * sampling.n
        if count > self.max_waiting:
            raise APIError(400, f"{len(prompts)} prompts x n={sampling.n} is {count} requests, more than this server "
                                f"queues ({self.max_waiting}): send fewer", param="n")
        fmt = sampling.options.get("response_format")
        constraints = None              # one matcher a choice, built off the event loop and the engine's thread
        if fmt is not None:
            try:
                constraints = await asyncio.to_thread(self.runner.constraints, fmt, count)
            except ValueError as e:
                raise APIError(400, str(e), param=sampling.format_field) from None
        if self.engine.queue_depth + count > self.max_waiting:
            raise APIError(503, f"the server is at its limit of {self.max_waiting} waiting requests; retry later",
                           code="overloaded")
        arrived = time.monotonic()
        queued = []                     # every choice queued at once, counted in queue_depth before any await
        for ids in prompts:
            wanted = sampling.max_tokens if sampling.max_tokens is not None else self.max_len - len(ids)
            for j in range(sampling.n):
                options = dict(sampling.options)
                if "seed" in options and sampling.n > 1:
                    options["seed"] = (options["seed"] + j) % (1 << 31)
                if constraints:
                    options["response_format"] = constraints[len(queued)]
                try:
                    queued.append(self.engine.enqueue(ids, wanted, **options))
                except RuntimeError as e:        # shutting down, or the engine failed: the rest are not queued
                    queued.append(e)
        results = await asyncio.gather(*(self._started(q) for q in queued), return_exceptions=True)
        choices = [_Choice(i, *r, arrived) for i, r in enumerate(results) if not isinstance(r, BaseException)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.close(choices)
            if isinstance(failed[0], (ValueError, TypeError)):
                raise APIError(400, str(failed[0]))
            if isinstance(failed[0], RuntimeError):          # shutting down, or the engine failed
                raise APIError(503, str(failed[0]), code="shutting_down")
            raise failed[0]
        return choices

    async def _started(self, queued):
        if isinstance(queued, BaseException):
            raise queued
        return await self.engine.started(queued)

    async def close(self, choices: list[_Choice]) -> None:
        """Abort choices already queued (their output streams may never have started, so closing them is not
        enough)."""
        for c in choices:
            self.engine.abort(c.request.id)
            await c.outputs.aclose()

    async def drain(self, choice: _Choice) -> None:
        async with contextlib.aclosing(choice.outputs) as outputs:
            async for out in outputs:
                choice.took(out, self.metrics)
        if choice.finish_reason is None:
            choice.finish_reason = "abort"

    async def collect(self, request: Request, choices: list[_Choice]) -> bool:
        """Run every choice to its end; False (each aborted) when the client went away first."""
        task = asyncio.ensure_future(asyncio.gather(*(self.drain(c) for c in choices)))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.2)
                if done:
                    task.result()
                    return True
                if await request.is_disconnected():
                    return False
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def total_usage(self, prompts: list[list[int]], choices: list[_Choice]) -> dict:
        return usage(sum(len(p) for p in prompts), sum(c.completion_tokens for c in choices),
                     sum(c.cached_tokens for c in choices[::max(1, len(choices) // len(prompts))]))

    async def respond(self, request: Request, chat: bool, prompts: list[list[int]], sampling) -> Response:
        choices = await self.submit(prompts, sampling)
        rid = new_id("chatcmpl" if chat else "cmpl")
        if sampling.stream:
            return StreamingResponse(self.events(chat, rid, prompts, choices, sampling.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if not await self.collect(request, choices):
            return Response(status_code=499)
        if chat:
            body = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                     "finish_reason": c.finish_reason} for c in choices]
        else:
            body = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                    for c in choices]
        return JSONResponse(envelope("chat.completion" if chat else "text_completion", rid, self.model_name, body,
                                     self.total_usage(prompts, choices)))

    async def _streams(self, choices: list[_Choice]):
        """(choice, Output | Exception | None) of every choice as its outputs come, None ending that choice's
        stream (after an Exception where the engine failed): a lone choice read directly, several merged by a task
        each."""
        async def read(choice: _Choice):
            try:
                async with contextlib.aclosing(choice.outputs) as outputs:
                    async for out in outputs:
                        choice.took(out, self.metrics)
                        yield choice, out
            except Exception as e:          # noqa: BLE001 - reported in the stream
                yield choice, e
            yield choice, None
        if len(choices) == 1:
            async with contextlib.aclosing(read(choices[0])) as items:
                async for item in items:
                    yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: _Choice):
            async with contextlib.aclosing(read(choice)) as items:
                async for item in items:
                    await queue.put(item)
        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            open_ = len(choices)
            while open_:
                item = await queue.get()
                open_ -= item[1] is None
                yield item
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    async def events(self, chat: bool, rid: str, prompts, choices: list[_Choice], include_usage: bool):
        """The server-sent events of a streamed response; a client that leaves cancels this, aborting each choice.
        One event an output: a token's text (empty while a character is incomplete), or all that a choice made
        while its stream was busy sending."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        # every chunk's envelope is this stream's: serialized once, each chunk's choice put in its place
        head, _, tail = json.dumps(envelope(kind, rid, self.model_name, [_SLOT])).partition(json.dumps([_SLOT]))

        def chunk(choice: _Choice, text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                part = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                part = {"index": choice.index, "text": text or "", "logprobs": None, "finish_reason": finish}
            return f"data: {head}[{json.dumps(part)}]{tail}\n\n"

        async with contextlib.aclosing(self._streams(choices)) as items:
            if chat:
                for c in choices:
                    yield chunk(c, None, None, role=True)
            async for choice, item in items:
                if item is None:
                    if choice.finish_reason is None:
                        choice.finish_reason = "abort"
                        yield chunk(choice, None, "abort")
                elif isinstance(item, Exception):
                    yield f"data: {json.dumps(APIError(500, f'the engine failed: {item}').body())}\n\n"
                else:
                    yield chunk(choice, item.text, item.finish_reason if item.finished else None)
            if include_usage:
                final = envelope(kind, rid, self.model_name, [], self.total_usage(prompts, choices))
                yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

    # -- routes ---------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = await self.body(request)
        sampling = parse_sampling(body, self.vocab)
        ids = await self.encode_chat(parse_messages(body))
        return await self.respond(request, True, [ids], sampling)

    async def completions(self, request: Request) -> Response:
        body = await self.body(request)
        sampling = parse_sampling(body, self.vocab)
        prompts = [await self.encode(p) for p in parse_prompts(body, self.vocab)]
        if body.get("echo") or body.get("suffix") or body.get("best_of") not in (None, 1):
            raise APIError(400, "echo, suffix and best_of are not supported", param="echo")
        return await self.respond(request, False, prompts, sampling)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                          "created": self.created, "owned_by": "tilekit",
                                                          "max_model_len": self.max_len}]})

    async def health(self, request: Request) -> Response:
        alive = self.engine.thread.is_alive() and self.engine.error is None
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    async def prometheus(self, request: Request) -> Response:
        self.authorize(request)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")


def build_app(server: Server, lifespan=None) -> Starlette:
    async def api_error(request, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def http_error(request, exc: HTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    async def server_error(request, exc: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}").body(), status_code=500)

    routes = [Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
              Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/models", server.models, methods=["GET"]),
              Route("/health", server.health, methods=["GET"]),
              Route("/metrics", server.prometheus, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})

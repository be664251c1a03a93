"""A serving benchmark in the manner of vLLM's: random token-id prompts sent to an OpenAI-compatible server's
/v1/completions, streamed, at a request rate (Poisson arrivals; inf: all at once) under a concurrency cap. The
prompts are the continuous-batching study's workload (benchmarks.studies.continuous), so that its offline run of the
same requests is the server's ceiling.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --model NAME [--num-prompts 256]
        [--input-len 256 1024] [--output-len 128 128] [--max-concurrency 64] [--request-rate inf] [--out FILE]

Per request: time to first token (TTFT), time per output token after the first (TPOT: from the first event to the
last over the tokens after the first), every gap between streamed events (ITL) and end-to-end latency (E2E);
reported as mean, median and p99, with request and output-token throughput, printed as a table and saved as JSON. A
request that fails, or returns fewer tokens than asked (eos is ignored), is counted
as failed; a run with failures exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.studies.continuous import workload


async def one(client, url: str, model: str, prompt: list[int], n: int, headers: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, tokens, error = [], None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("choices"):
                        stamps.append(time.perf_counter())
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
    except Exception as e:         # noqa: BLE001 - a failed request is a result
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error is None and tokens != n:
        error = f"{tokens} tokens of {n}"
    gaps = list(np.diff(stamps)) if len(stamps) > 1 else []
    # TPOT per output token after the first, as vLLM's: a server that sends several tokens in one event is not
    # credited with fewer, longer steps
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if stamps and tokens and tokens > 1 else None
    return dict(ok=error is None, error=error, ttft=stamps[0] - start if stamps else None, e2e=end - start,
                tokens=tokens or 0, itl=gaps, tpot=tpot)


async def run(args, reqs) -> tuple[list[dict], float]:
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency)
    rng = np.random.default_rng(1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=args.max_concurrency + 8)) as client:
        async def limited(prompt, n):
            async with limit:
                return await one(client, args.base_url, args.model, prompt, n, headers)
        tasks = []
        start = time.perf_counter()
        for prompt, n in reqs:
            tasks.append(asyncio.ensure_future(limited(prompt, n)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summary(results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if r["ok"]]

    def stats(values):
        values = [v for v in values if v is not None]
        if not values:
            return None
        ms = np.asarray(values) * 1e3
        return dict(mean=float(ms.mean()), median=float(np.median(ms)), p99=float(np.percentile(ms, 99)))
    return dict(completed=len(ok), failed=len(results) - len(ok), seconds=seconds,
                request_throughput=len(ok) / seconds, output_throughput=sum(r["tokens"] for r in ok) / seconds,
                ttft_ms=stats([r["ttft"] for r in ok]), tpot_ms=stats([r["tpot"] for r in ok]),
                itl_ms=stats([g for r in ok for g in r["itl"]]), e2e_ms=stats([r["e2e"] for r in ok]),
                errors=sorted({r["error"] for r in results if not r["ok"]})[:5])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model's name")
    p.add_argument("--api-key")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=(256, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(128, 128), metavar=("MIN", "MAX"))
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all at once)")
    p.add_argument("--out", type=Path, help="JSON file for the summary")
    args = p.parse_args(argv)
    if args.max_concurrency < 1 or args.num_prompts < 1 or args.request_rate <= 0:
        p.error("--max-concurrency and --num-prompts must be positive, --request-rate above 0")
    reqs = workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), 0, args.vocab_size)
    results, seconds = asyncio.run(run(args, reqs))
    s = summary(results, seconds)
    print(f"concurrency {args.max_concurrency}, rate {args.request_rate}: {s['completed']} ok, {s['failed']} failed "
          f"in {seconds:.2f} s; {s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} output tok/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[name]
        if v:
            print(f"  {name[:-3].upper():5s} mean {v['mean']:9.2f} ms  median {v['median']:9.2f} ms  "
                  f"p99 {v['p99']:9.2f} ms")
    for e in s["errors"]:
        print(f"  error: {e}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, **s), indent=1))
    return 0 if not s["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())

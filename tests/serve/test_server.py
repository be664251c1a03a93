"""tilekit serve end to end on the CPU: the official OpenAI client (chat and completions, streamed and not, n,
stop, usage), greedy text equal to the model's own generate(), errors in OpenAI's shape (auth, bad JSON, bad UTF-8,
wrong types, huge bodies, unknown models, the context), a disconnecting client's request aborted with its blocks
returned, overload answered 503, metrics; and `tilekit serve` as a process: SIGTERM lets the running request finish
and exits 0."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.serve.conftest import free_port, wait_healthy

openai = pytest.importorskip("openai")


def greedy_text(running, prompt: str, n: int) -> str:
    """What the model's own generate() continues `prompt` with (greedy, eos ignored), decoded."""
    model = running.engine.engine.model
    ids = model.runner._encoded(prompt)
    out = model.generate([ids], n, temperature=0, eos_token_id=[])[0][len(ids):]
    return model.runner.tokenizer().decode([int(t) for t in out])


def test_completions_with_the_openai_client(serve):
    check_completions(serve())


def check_completions(running):
    """The completions endpoint through the openai client: strings, lists, token ids, streamed; greedy text equal to
    the model's own generate()."""
    client = running.client()
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == greedy_text(running, "Hello there", 8)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    many = client.completions.create(model="tiny", prompt=["one", "two three"], max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[1].text == greedy_text(running, "two three", 4)
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3
    streamed = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=["one", "two three"], max_tokens=4, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    for i, choice in enumerate(many.choices):        # several choices' events, interleaved, each to its own text
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == "length"
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1


def test_chat_with_the_openai_client(serve):
    check_chat(serve())


def check_chat(running):
    """The chat endpoint through the openai client: the chat template, streaming with usage, n with a seed."""
    client = running.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.choices[0].message.content == greedy_text(running, "system: be brief\nuser: Hi\nassistant:", 6)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    two = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=2, temperature=1.0,
                                         seed=4, extra_body={"ignore_eos": True})
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=2, temperature=1.0,
                                           seed=4, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]


def test_stop_strings_and_unknown_fields(serve):
    running = serve()
    client = running.client()
    full = greedy_text(running, "Hello there", 10)
    stop = full[3:5]
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=10, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True, "some_future_field": {"x": 1}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]


def test_errors_have_the_openai_shape(serve, checkpoint):
    running = serve()
    url = running.url
    auth = {"Authorization": "Bearer test-key"}

    def post(path, body, headers=auth):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(url + path, content=data, headers={**headers, "Content-Type": "application/json"})

    def error(resp, status, pattern):
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert re.search(pattern, err["message"]), err
        return err
    error(post("/v1/completions", {"prompt": "x"}, headers={}), 401, "API key")
    error(post("/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401, "API key")
    assert httpx.get(url + "/health").status_code == 200                  # no key needed
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
    error(post("/v1/completions", b"{not json"), 400, "not valid JSON")
    error(post("/v1/completions", b'{"prompt": "\xff\xfe"}'), 400, "not UTF-8")
    error(post("/v1/completions", b"[1, 2]"), 400, "JSON object")
    error(post("/v1/completions", b'{"prompt": "x", "temperature": NaN}'), 400, "not valid JSON")
    assert error(post("/v1/completions", {"prompt": "x", "temperature": "hot"}), 400, "number")["param"] == \
        "temperature"
    assert error(post("/v1/completions", {"prompt": "x", "max_tokens": True}), 400, "integer")["param"] == "max_tokens"
    error(post("/v1/completions", {"prompt": "x", "top_p": 0}), 400, "top_p")
    error(post("/v1/completions", {"prompt": "x", "n": 100}), 400, "n:")
    error(post("/v1/completions", {"prompt": []}), 400, "prompt")
    error(post("/v1/completions", {"prompt": [10 ** 9]}), 400, "token ids")
    error(post("/v1/completions", {"prompt": "x", "logprobs": 2}), 400, "log probabilities")
    error(post("/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    error(post("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}), 400, "content")
    err = error(post("/v1/completions", {"prompt": "x", "max_tokens": 500}), 400, "context is 64 tokens")
    assert "max_tokens is 500" in err["message"] and err["param"] == "max_tokens"
    error(post("/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "does not exist")
    error(post("/v1/completions", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}"), 400, "finite number")
    error(post("/v1/completions", {"prompt": ["x"] * 20, "n": 16, "temperature": 1}), 400, "more than this server")
    error(post("/v1/completions", b"{" + b" " * (5 << 20) + b"}"), 413, "over")
    error(httpx.get(url + "/v1/completions", headers=auth), 405, "")
    error(httpx.get(url + "/nowhere", headers=auth), 404, "")
    assert httpx.get(url + "/health").status_code == 200                  # still serving


def test_a_refused_prompt_aborts_the_ones_queued_before_it(serve):
    running = serve(delay=0.02, num_blocks=9)          # 8 blocks of 4: 32 positions
    body = {"model": "tiny", "prompt": [[1, 2, 3], [5] * 40], "max_tokens": 20, "ignore_eos": True}
    resp = httpx.post(running.url + "/v1/completions", json=body, headers={"Authorization": "Bearer test-key"})
    assert resp.status_code == 400 and "more blocks than the KV cache has" in resp.json()["error"]["message"]
    llm = running.engine.engine
    for _ in range(100):
        if not llm.has_unfinished:
            break
        time.sleep(0.02)
    assert not llm.has_unfinished and llm.pool.used == 0 and llm.counters["generation_tokens"] < 20


def disconnect_after_first_event(running, polls: int = 100) -> None:
    """Stream a 50-token completion, leave after its first event, and wait for the engine to drop the request;
    asserts its blocks were in use and came back, and that it stopped short."""
    llm = running.engine.engine
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 50, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", running.url + "/v1/completions", json=body,
                      headers={"Authorization": "Bearer test-key"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break
        assert llm.pool.used > 0
    for _ in range(polls):
        if not llm.has_unfinished and llm.pool.used == 0:
            break
        time.sleep(0.05)
    assert not llm.has_unfinished and llm.pool.used == 0
    assert llm.counters["generation_tokens"] < 50


def test_a_client_that_disconnects_is_aborted_and_its_blocks_return(serve):
    running = serve(delay=0.05)
    disconnect_after_first_event(running)
    llm = running.engine.engine
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 50, "temperature": 0, "ignore_eos": True}

    async def leave_early():         # not streamed: the client gives up while it waits
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(running.url + "/v1/completions", json=body, timeout=0.5,
                                  headers={"Authorization": "Bearer test-key"})
    before = llm.counters["generation_tokens"]
    asyncio.run(leave_early())
    for _ in range(100):
        if not llm.has_unfinished:
            break
        time.sleep(0.05)
    assert not llm.has_unfinished and llm.pool.used == 0 and llm.counters["generation_tokens"] - before < 50


def test_overload_is_503_with_retry_after_and_nothing_is_lost(serve):
    running = serve(delay=0.02, max_running=1, max_waiting=2)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 10, "temperature": 0, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(running.url + "/v1/completions", json=body,
                                                      headers={"Authorization": "Bearer test-key"})
                                          for _ in range(8)))
    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}
    for r in replies:
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 10
    assert not running.engine.engine.has_unfinished


def test_metrics(serve):
    running = serve()
    running.client().completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
    text = httpx.get(running.url + "/metrics", headers={"Authorization": "Bearer test-key"}).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "prefix_cache_hit_rate",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count", "generation_tokens_total"):
        assert f"tilekit:{name}" in text, name
    assert re.search(r'tilekit:request_success_total\{finished_reason="length",model_name="tiny"\} 1.0', text)
    assert re.search(r'tilekit:generation_tokens_total\{model_name="tiny"\} 4.0', text)


def test_the_serve_command_ends_cleanly_on_sigterm(checkpoint):
    port = free_port()
    env = dict(os.environ, TILEKIT_API_KEY="secret-key-123")
    proc = subprocess.Popen([sys.executable, "-m", "tilekit", "serve", "--model", str(checkpoint), "--device", "cpu",
                             "--port", str(port), "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret-key-123", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"      # the running request finished
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert first.choices and "secret-key-123" not in err and "Traceback" not in err, err


def test_serve_refuses_bad_arguments_before_loading(tmp_path):
    def run(*argv, env=None):
        return subprocess.run([sys.executable, "-m", "tilekit", "serve", *argv], capture_output=True, text=True,
                              env=dict(os.environ, **(env or {})), timeout=60)
    r = run("--model", str(tmp_path), "--port", "70000")
    assert r.returncode == 2 and "--port" in r.stderr
    r = run("--model", str(tmp_path), "--device", "cpu", env={"TILEKIT_API_KEY": "has space"})
    assert r.returncode == 2 and "TILEKIT_API_KEY" in r.stderr and "has space" not in r.stderr
    r = run("--model", str(tmp_path / "missing"), "--device", "cpu")
    assert r.returncode == 2 and "missing" in r.stderr

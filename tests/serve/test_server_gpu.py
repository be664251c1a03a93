"""The server's client tests on the GPU engine (tilekit's GPT-2 through the PagedExecutor): completions and chat with
the official openai client, greedy text equal to the GPU model's own generate(), and a disconnecting client's
request aborted with its blocks returned."""

import time

import httpx
import pytest

from tests.serve.test_server import check_chat, check_completions

pytestmark = pytest.mark.gpu


def test_completions_and_chat_on_the_gpu_engine(serve):
    running = serve(gpu=True)
    check_completions(running)
    check_chat(running)


def test_a_disconnected_stream_returns_its_blocks_on_the_gpu(serve):
    running = serve(gpu=True)
    llm = running.engine.engine
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 50, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", running.url + "/v1/completions", json=body,
                      headers={"Authorization": "Bearer test-key"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break
    for _ in range(200):
        if not llm.has_unfinished and llm.pool.used == 0:
            break
        time.sleep(0.05)
    assert not llm.has_unfinished and llm.pool.used == 0

"""The server's client tests on the GPU engine (tilekit's GPT-2 through the PagedExecutor): completions and chat with
the official openai client, greedy text equal to the GPU model's own generate(), and a disconnecting client's
request aborted with its blocks returned."""

import pytest

from tests.serve.test_server import check_chat, check_completions, disconnect_after_first_event

pytestmark = pytest.mark.gpu


def test_completions_and_chat_on_the_gpu_engine(serve):
    running = serve(gpu=True)
    check_completions(running)
    check_chat(running)


def test_a_disconnected_stream_returns_its_blocks_on_the_gpu(serve):
    disconnect_after_first_event(serve(gpu=True), polls=200)

"""A server on a tiny random GPT-2 (the NumPy reference through the continuous-batching engine): a checkpoint with a
chat template, and the server running in a thread of this process (uvicorn on a free port), its engine's steps
slowed down where a test needs requests to stay in flight."""

import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "tiny-gpt2"
TEMPLATE = ('{"chat_template": "{% for m in messages %}{{ m[\'role\'] }}: {{ m[\'content\'] }}\\n{% endfor %}'
            '{% if add_generation_prompt %}assistant:{% endif %}"}')


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat-gpt2") / "tiny-chat-gpt2"
    shutil.copytree(DATA, d)
    (d / "tokenizer_config.json").write_text(TEMPLATE)
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, seconds: float = 30.0) -> None:
    """Until the server at `url` answers /health with 200 (at most `seconds`)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} did not become healthy in {seconds} s")


class SlowExecutor:
    """An executor whose steps take at least `delay` seconds (requests stay in flight long enough to disconnect)."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def launch(self, step, constraints=None):
        start = time.monotonic()
        handle = self.inner.launch(step, constraints)
        time.sleep(max(0.0, self.delay - (time.monotonic() - start)))
        return handle

    def collect(self, handle):
        return self.inner.collect(handle)

    def forget(self, request):
        self.inner.forget(request)

    def prepare_masks(self, constraints):
        self.inner.prepare_masks(constraints)

    def release(self):
        self.inner.release()


class Running:
    def __init__(self, url, engine, server):
        self.url, self.engine, self.server = url, engine, server

    def client(self, **kw):
        from openai import OpenAI
        return OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "test-key"), max_retries=0, **kw)


@pytest.fixture
def serve(checkpoint):
    """serve(delay=0, max_running=8, gpu=False, **Server kwargs) -> Running (gpu: the GPU model, else the NumPy
    reference); every server started is stopped at the test's end."""
    import uvicorn

    from tilekit.engine.llm import AsyncEngine, LLMEngine
    from tilekit.models.gpt2.reference import ReferenceGPT
    from tilekit.serve.app import Server, build_app
    started = []

    def start(delay: float = 0.0, max_running: int = 8, gpu: bool = False, num_blocks: int | None = None, **kwargs):
        if gpu:         # tilekit's GPU model through the PagedExecutor (its pool: 2% of the free memory)
            from tilekit.models import load_model
            llm = LLMEngine(load_model(checkpoint, dtype="float32"), max_running=max_running, token_budget=64,
                            block=16, gpu_memory_utilization=0.02, compile_workers=2)
        else:
            llm = LLMEngine(ReferenceGPT.from_pretrained(checkpoint, dtype="float32"), max_running=max_running,
                            token_budget=64, block=4, num_blocks=num_blocks)
        if delay:
            llm.executor = SlowExecutor(llm.executor, delay)
        engine = AsyncEngine(llm)
        kwargs.setdefault("api_key", "test-key")
        server = Server(engine, "tiny", **kwargs)
        port = free_port()
        uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=uv.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        started.append((uv, thread, engine))
        return Running(url, engine, server)
    yield start
    for uv, thread, engine in started:
        uv.should_exit = True
        thread.join(10)
        engine.shutdown(timeout=5)

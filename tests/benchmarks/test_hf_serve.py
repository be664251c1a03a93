"""The serving benchmark's transformers anchor (benchmarks.hf_serve) on a stand-in for transformers'
ContinuousBatchingManager (its add_request / get_result / cancel_request, cumulative streamed outputs): every request
of benchmarks.serve completes with its tokens, bad bodies are 400s, a failed request or a stopped generation loop ends
its stream with an error, and a client that goes away cancels its request."""

import json
import queue
import threading
import time
import types

import httpx
import pytest

from benchmarks import serve as bench
from tests.serve.conftest import free_port, wait_healthy


class FakeManager:
    """One token per request per step, outputs carrying every token so far, as the manager streams them."""

    def __init__(self, fail_after: int | None = None):
        self.outputs, self.active, self.cancelled = queue.Queue(), {}, []
        self.lock, self.fail_after, self.running = threading.Lock(), fail_after, True
        threading.Thread(target=self._steps, daemon=True).start()

    def is_running(self):
        return self.running

    def add_request(self, input_ids, request_id, max_new_tokens, streaming):
        assert streaming and input_ids
        with self.lock:
            self.active[request_id] = (max_new_tokens, [])

    def cancel_request(self, request_id):
        with self.lock:
            self.active.pop(request_id, None)
            self.cancelled.append(request_id)

    def get_result(self, timeout=None):
        try:
            return self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None

    def _steps(self):
        while self.running:
            time.sleep(0.002)
            with self.lock:
                for request_id, (n, tokens) in list(self.active.items()):
                    tokens.append(len(tokens) + 7)
                    done = len(tokens) == n
                    error = "out of blocks" if self.fail_after is not None and len(tokens) > self.fail_after else None
                    status = types.SimpleNamespace(name="FAILED" if error else "FINISHED" if done else "DECODING")
                    self.outputs.put(types.SimpleNamespace(request_id=request_id, generated_tokens=tokens,
                                                           status=status, error=error,
                                                           is_finished=lambda s=status: s.name == "FINISHED"))
                    if done or error:
                        del self.active[request_id]


@pytest.fixture
def anchor():
    import uvicorn

    from benchmarks.hf_serve import Router, build_app
    started = []

    def start(manager):
        router = Router(manager)
        router.thread.start()
        port = free_port()
        uv = uvicorn.Server(uvicorn.Config(build_app(manager, router), host="127.0.0.1", port=port,
                                           log_level="warning"))
        thread = threading.Thread(target=uv.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        started.append((uv, thread, router))
        return url
    yield start
    for uv, thread, router in started:
        uv.should_exit = True
        thread.join(10)
        router.stopping.set()


def test_the_serving_benchmark_completes_every_request_on_the_anchor(anchor, tmp_path):
    url = anchor(FakeManager())
    out = tmp_path / "anchor.json"
    argv = ["--base-url", url, "--model", "hf", "--num-prompts", "16", "--input-len", "4", "12", "--output-len", "3",
            "9", "--vocab-size", "1000", "--max-concurrency", "8", "--out", str(out)]
    assert bench.main(argv) == 0
    s = json.loads(out.read_text())
    assert s["completed"] == 16 and s["failed"] == 0 and s["output_throughput"] > 0


def test_bad_bodies_failures_and_disconnects(anchor):
    manager = FakeManager(fail_after=2)
    url = anchor(manager)
    for body, field in (({"prompt": "text", "max_tokens": 4}, "prompt"), ({"prompt": [1, 2], "max_tokens": 0},
                                                                         "max_tokens"),
                        ({"prompt": [1, -2], "max_tokens": 3}, "prompt")):
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 400 and field in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/completions", content=b"{not json").status_code == 400
    lines = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 50}).text.splitlines()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-2]["error"]["message"] == "out of blocks" and events[-1]["usage"]["completion_tokens"] == 2
    manager.fail_after = None
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": [4], "max_tokens": 100000}) as r:
        next(r.iter_lines())                           # the first event, then the client goes away
    deadline = time.monotonic() + 10
    while not manager.cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.cancelled and not manager.active
    manager.running = False                            # the generation loop died: open streams end with an error
    lines = httpx.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 10}, timeout=30).text.splitlines()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "generation loop stopped" in events[-2]["error"]["message"]

"""benchmarks.serve against the CPU server: every request completes with its tokens, the summary's figures are
consistent, failures are counted (a wrong API key) and make the exit status 1."""

import json

from benchmarks import serve as bench


def test_the_serving_benchmark_runs_and_counts(serve, tmp_path):
    running = serve()
    out = tmp_path / "serve.json"
    argv = ["--base-url", running.url, "--model", "tiny", "--api-key", "test-key", "--num-prompts", "12",
            "--input-len", "4", "12", "--output-len", "3", "6", "--vocab-size", "1000", "--max-concurrency", "4",
            "--out", str(out)]
    assert bench.main(argv) == 0
    s = json.loads(out.read_text())
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["ttft_ms"]["median"] <= s["e2e_ms"]["median"] and s["itl_ms"]["p99"] >= s["itl_ms"]["median"]
    assert s["output_throughput"] > 0
    assert bench.main(argv[:4] + ["--api-key", "wrong", "--num-prompts", "2", "--request-rate", "50",
                                  "--out", str(out)]) == 1
    assert json.loads(out.read_text())["failed"] == 2

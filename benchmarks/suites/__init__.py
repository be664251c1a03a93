"""The benchmark suites `python -m benchmarks` runs (kernels, model, tuning, overhead) and the patched-model
benchmark, with the anchors they time tilekit against (gptfast)."""

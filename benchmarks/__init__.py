"""tilekit benchmarks: kernels and models against torch, CuPy and Hugging Face.

harness/ (timing, system facts, checks, reports, plots), suites/ (what `python -m benchmarks` runs: kernels,
model, tuning, overhead; and the patched-model benchmark), studies/ (breakdowns and A/B experiments). Run
``python -m benchmarks --help``; see benchmarks/README.md for what is measured and how.
"""

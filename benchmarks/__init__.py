"""tilekit benchmarks: kernels and the GPT-2 model against torch, CuPy and Hugging Face.

Run ``python -m benchmarks --help``; see benchmarks/README.md for what is measured and how.
"""

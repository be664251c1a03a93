"""The continuous-batching study's workload and roofline (CPU: arithmetic only)."""

from benchmarks.harness.report import kv_width, layer_matmul_params, streamed_params
from benchmarks.studies.continuous import roofline_seconds, workload
from tilekit.models.families import preset_config


def test_the_workload_keeps_its_ranges_and_shared_prefix():
    reqs = workload(50, (20, 40), (3, 9), shared=16, vocab=1000, seed=3)
    assert len(reqs) == 50
    assert all(20 <= len(p) <= 40 and 3 <= n <= 9 for p, n in reqs)
    assert len({tuple(p[:16]) for p, _ in reqs}) == 1 and len({tuple(p[16:]) for p, _ in reqs}) == 50


def test_the_roofline_of_one_request_by_hand():
    config = preset_config("llama-3.2-1b")
    prompt, n, running, gbs, tflops = [1] * 100, 10, 4, 1000.0, 500.0
    L = config.n_layer
    flops = 2 * 100 * L * layer_matmul_params(config) + 4 * L * config.n_head * config.head_dim * 100 * 101 / 2
    steps = 3                                                   # 10 tokens, at most 4 a step
    kv = 2 * L * kv_width(config) * 2 * sum(100 + j for j in range(n))
    expected = flops / 500e12 + (steps * streamed_params(config, running) * 2 + kv) / 1000e9
    assert abs(roofline_seconds(config, [(prompt, n)], running, gbs, tflops) - expected) < 1e-12 * expected
    # twice the requests at twice the running cap: the same weight reads, twice the FLOPs and KV
    two = roofline_seconds(config, [(prompt, n)] * 2, 2 * running, gbs, tflops)
    assert two > roofline_seconds(config, [(prompt, n)], running, gbs, tflops)


def test_the_roofline_of_a_mixture_of_experts_model_by_hand():
    """DeepSeek-V2-Lite: a token's prefill multiplies it by its 6 routed and 2 shared experts of 66, a decode step of
    R tokens reads the expected share of the routed ones, the latent cache holds 576 values per token and layer, and
    attention's plain form costs 2 H (192 + 128) FLOPs per pair."""
    import math

    from tilekit.models.deepseek_v2.weights import block_shapes
    config = preset_config("deepseek-v2-lite")
    L, E, K, S = config.n_layer, config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts
    matrices = experts = 0
    for i in range(L):
        for shape in block_shapes(config, i).values():
            matrices += math.prod(shape) if len(shape) == 2 else 0
            experts += math.prod(shape) if len(shape) == 3 else 0
    prompt, n, running, gbs, tflops = [1] * 100, 10, 4, 1000.0, 500.0
    flops = 2 * 100 * (matrices + experts * (K + S) / (E + S)) + L * 2 * 16 * (192 + 128) * 100 * 101 / 2
    unread = experts * E * (1 - K / E) ** running / (E + S)
    kv = L * 576 * 2 * sum(100 + j for j in range(n))
    expected = flops / 500e12 + (3 * (streamed_params(config, running) - unread) * 2 + kv) / 1000e9
    assert abs(roofline_seconds(config, [(prompt, n)], running, gbs, tflops) - expected) < 1e-9 * expected


def test_the_leading_agreement_check():
    from benchmarks.studies.continuous import leading_agreement
    ours = [[1, 2, 3, 4, 5]] * 8
    close = [[1, 2, 3, 4, 9]] * 6 + [[7, 2, 3, 4, 5]] * 2          # 6 of 8 agree on their first 4 tokens
    leading, check = leading_agreement(ours, close)
    assert leading == [4] * 6 + [0] * 2 and check == "ok"
    leading, check = leading_agreement(ours, [[1, 9, 3, 4, 5]] * 8)
    assert leading == [1] * 8 and check.startswith("FAILED: 0 of 8")


def test_the_transformers_anchor_needs_one_output_length(capsys):
    import pytest

    from benchmarks.studies.continuous import main
    with pytest.raises(SystemExit):
        main(["--transformers", "--output", "64", "512"])
    assert "--transformers needs one output length" in capsys.readouterr().err

"""The quant study's accuracy column (CPU: a stand-in model)."""

import numpy as np
import pytest

from benchmarks.studies.quant import next_token_agreement


class Echo:
    """Logits that pick, at each position, the token `shift` after the one fed there (mod vocab)."""

    def __init__(self, vocab, shift):
        self.vocab, self.shift = vocab, shift

    def __call__(self, ids):
        logits = np.zeros(ids.shape + (self.vocab,), np.float32)
        np.put_along_axis(logits, ((ids + self.shift) % self.vocab)[..., None], 1.0, axis=-1)
        return logits


def test_next_token_agreement_compares_each_generated_position_given_the_reference_history():
    prompt, vocab = 3, 11
    sequences = (np.arange(2 * 8).reshape(2, 8) % vocab)          # each next token is the last plus one
    sequences[1, 5] = 0                                           # except one generated position (of 10)
    assert next_token_agreement(Echo(vocab, 1), sequences, prompt) == 8 / 10
    assert next_token_agreement(Echo(vocab, 2), sequences, prompt) == 0.0


def test_the_linear_rows_check_outputs_against_dequantized_float64_products():
    """expanded / dequantized give every element its scale (per row, per 128 x 128 block, per row and 128-column
    group), and output_problem passes a right product and names a wrong or non-finite one (torch on the CPU)."""
    torch = pytest.importorskip("torch")
    from benchmarks.studies.quant import dequantized, expanded, output_problem
    N, K, M = 300, 520, 5
    per_row, blocks, groups = torch.rand(N), torch.rand(3, 5), torch.rand(M, 5)
    assert torch.equal(expanded(per_row, (N, K))[:, 7], per_row.double())
    full = expanded(blocks, (N, K))
    assert full.shape == (N, K) and full[129, 257] == blocks[1, 2] and full[299, 519] == blocks[2, 4]
    assert expanded(groups, (M, K))[2, 300] == groups[2, 2]
    codes = torch.randn(N, K).to(torch.float8_e4m3fn).view(torch.uint8)
    w = dequantized(codes, blocks, "fp8")
    assert torch.equal(w, codes.view(torch.float8_e4m3fn).double() * full)
    ref = torch.randn(M, K).double() @ w.t()
    assert output_problem(ref.to(torch.bfloat16), ref, "bfloat16") is None
    assert output_problem((ref * 1.05).to(torch.bfloat16), ref, "bfloat16").startswith(
        "output (bfloat16 tolerance): relative error 0.05")
    assert "relative error inf" in output_problem(torch.full((M, N), float("nan")), ref, "bfloat16")

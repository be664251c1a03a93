"""The quant study's accuracy column (CPU: a stand-in model)."""

import numpy as np

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

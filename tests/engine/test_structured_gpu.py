"""Structured output through generate() on the GPU, GPT-2 and Llama: the decode step's forward runs while the host
advances the matchers, then the masked pick. Rows of one batch whose grammars complete at different steps each equal
the row run alone, graph or eager, and every complete output validates against the schema."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parents[1] / "data"
# a schema each whose greedy answers differ in length from prompt to prompt with the model's random weights
SCHEMAS = {"tiny-gpt2": {"type": "object",
                         "properties": {"n": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                         "maximum": 999}, "maxItems": 6},
                                        "k": {"enum": ["x", "yz", "abc"]}},
                         "required": ["n", "k"], "additionalProperties": False},             # at most 41 characters
           "tiny-llama": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5},
                                                           "k": {"enum": ["x", "yz", "abc"]}},
                          "required": ["s", "k"], "additionalProperties": False}}           # at most 38 bytes
EOS = {"tiny-gpt2": {1030}, "tiny-llama": {257, 258}}


def byte_tokenizer(path: Path, specials: list[str]) -> None:
    """A byte-level tokenizer with no merges: ids 0-255 the bytes, then `specials` (a vocabulary as small as the
    tiny Llama's 259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(path))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """tiny-gpt2 as it is; tiny-llama copied with a byte-level tokenizer (its eos ids 257 and 258 the specials)."""
    llama = tmp_path_factory.mktemp("tiny-llama-tokenized")
    for f in (DATA / "tiny-llama").iterdir():
        shutil.copy(f, llama / f.name)
    byte_tokenizer(llama / "tokenizer.json", ["<s>", "</s>", "<|eot|>"])
    return {"tiny-gpt2": DATA / "tiny-gpt2", "tiny-llama": llama}


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_rows_ending_at_different_steps_each_equal_the_row_alone(checkpoints, name):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    from tilekit.models import load_model
    model = load_model(checkpoints[name], dtype="float32")
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    rng = np.random.default_rng(4)
    V = model.config.vocab_size
    prompts = [[int(t) for t in rng.integers(0, min(V, 256), n)] for n in (3, 9, 5, 14)]
    together = model.generate(prompts, 48, temperature=0, response_format=fmt)
    eager = model.generate(prompts, 48, temperature=0, response_format=fmt, use_graph=False)
    tokenizer = model.runner.tokenizer()
    lengths = []
    for p, row, row_eager in zip(prompts, together, eager):
        alone = model.generate([p], 48, temperature=0, response_format=fmt)[0]
        assert row.tolist() == alone.tolist() == row_eager.tolist()
        out = [int(t) for t in row[len(p):]]
        lengths.append(len(out))
        assert len(out) < 48, f"a row ran out of tokens: {tokenizer.decode(out)!r}"
        jsonschema.validate(json.loads(tokenizer.decode([t for t in out if t not in EOS[name]])), schema)
    assert len(set(lengths)) > 1, f"every row made {lengths[0]} tokens: the batch never ran with a row stopped"

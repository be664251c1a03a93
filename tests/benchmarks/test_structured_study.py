"""The structured-output study's own pieces on the CPU: its trained tokenizer and its output checks."""

import pytest

from benchmarks.studies.structured import SCHEMA, allowed, train_tokenizer


def test_the_trained_tokenizer_has_its_size_and_end_token_and_round_trips():
    tok = train_tokenizer(2000)
    assert tok.get_vocab_size() == 2000 and tok.id_to_token(0) == "<|endoftext|>"
    text = '{"name": "abc", "n": 3}'
    assert tok.decode(tok.encode(text).ids) == text


def test_a_prefix_passes_the_token_check_only_while_the_schema_allows_each_token():
    pytest.importorskip("llguidance")
    from pathlib import Path
    from tilekit.models.gpt2.reference import ReferenceGPT
    runner = ReferenceGPT.from_pretrained(Path(__file__).resolve().parents[1] / "data" / "tiny-gpt2").runner
    tokenizer = runner.tokenizer()
    start = tokenizer.encode('{"name":"abc').ids         # (llguidance's JSON is compact: no blank after ':')
    assert allowed(runner, start)
    assert not allowed(runner, tokenizer.encode('{"n":5').ids)          # not the schema's first property
    assert not allowed(runner, tokenizer.encode('{"name":"ab"}').ids)   # a string far below its minimum length
    assert SCHEMA["properties"]["name"]["minLength"] == 3000              # more than any study run's tokens spell

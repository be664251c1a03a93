"""The structured-output study's own pieces on the CPU: its trained tokenizer and its output check."""

import json

import pytest

from benchmarks.studies.structured import SCHEMA, train_tokenizer, valid

pytest.importorskip("jsonschema")


def test_the_trained_tokenizer_has_its_size_and_end_token_and_round_trips():
    tok = train_tokenizer(2000)
    assert tok.get_vocab_size() == 2000 and tok.id_to_token(0) == "<|endoftext|>"
    text = '{"name": "abc", "n": 3}'
    assert tok.decode(tok.encode(text).ids) == text


def test_only_a_valid_answer_passes_the_check():
    good = {"name": "x" * 210, "n": 5, "tags": ["a"]}
    assert valid(json.dumps(good))
    assert not valid(json.dumps(dict(good, name="short")))
    assert not valid('{"name": ')
    assert SCHEMA["properties"]["name"]["minLength"] == 200

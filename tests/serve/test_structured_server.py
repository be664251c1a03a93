"""Structured output through the server with the official openai client (CPU engine, the tiny GPT-2): chat's
response_format (json_schema, json_object), completions' vLLM-style guided_* fields, streamed and not; malformed
formats are a 400 naming their field."""

import json
import re

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"k": {"enum": ["x", "yz"]}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
          "required": ["k", "n"], "additionalProperties": False}


def test_chat_with_a_json_schema_and_a_json_object(serve):
    client = serve().client()
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Give me JSON"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Any object"}],
                                           max_tokens=40, temperature=0.8, seed=3,
                                           response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].finish_reason == "length"


def test_guided_fields_on_completions_streamed_and_not(serve):
    client = serve().client()
    done = client.completions.create(model="tiny", prompt="Code:", max_tokens=20, temperature=0,
                                     extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", done.choices[0].text) and done.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Answer:", max_tokens=20, temperature=0, stream=True,
        extra_body={"guided_choice": ["yes", "no", "maybe"]}) if c.choices]
    assert "".join(pieces) in ("yes", "no", "maybe")
    done = client.completions.create(model="tiny", prompt="JSON:", max_tokens=40, temperature=0,
                                     extra_body={"guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    done = client.completions.create(model="tiny", prompt="G:", max_tokens=20, temperature=0,
                                     extra_body={"guided_grammar": 'start: "a" DIGIT DIGIT\nDIGIT: /[0-9]/'})
    assert re.fullmatch("a[0-9]{2}", done.choices[0].text)


@pytest.mark.parametrize("extra,param,pattern", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type is text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "schema must be"),
    ({"guided_regex": "([a-"}, "guided_regex", "regex"),
    ({"guided_json": "{not json"}, "guided_json", "JSON schema"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one of"),
])
def test_malformed_formats_are_400_naming_the_field(serve, extra, param, pattern):
    running = serve()
    resp = httpx.post(running.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5, **extra},
                      headers={"Authorization": "Bearer test-key"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and re.search(pattern, err["message"]), err
    assert not running.engine.engine.has_unfinished

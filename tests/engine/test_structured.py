"""Structured output through the engine (CPU): the tiny GPT-2 checkpoint (its byte-level tokenizer) through the NumPy
reference executor and through the PagedExecutor's own step code on NumPy stand-ins. Every output that the grammar
completed parses and validates against its schema; greedy constrained tokens equal a host-side loop that applies
the same masks to the reference model's logits; sampled tokens are always ones the mask allowed; constrained and
free requests share batches; bad formats are a ValueError naming response_format."""

import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.engine.test_paged import cpu  # noqa: F401  (a fixture)  # pyflakes: ignore
from tests._numpy_cupy import numpy_cupy  # noqa: F401  (a fixture)
from tilekit.engine.grammar import Constraint, accept_tokens, constraint_masks, ends_only, grammar_of, vocabulary
from tilekit.engine.llm import LLMEngine
from tilekit.kernels.token_bitmask import allowed_tokens, token_bitmask_reference
from tilekit.models.gpt2.reference import ReferenceGPT

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

DATA = Path(__file__).resolve().parents[1] / "data" / "tiny-gpt2"
V, EOS = 1031, 1030
PROMPT = [64, 290, 318]

SCHEMAS = [
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"k": {"enum": ["x", "yz"]}},
                                            "required": ["k"], "additionalProperties": False}},
     "required": ["p"], "additionalProperties": False},                                         # nesting, an enum
    {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "minItems": 1, "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["n", "ok"], "additionalProperties": False},                                   # arrays, numbers
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},                                      # a string pattern
    {"type": "array", "items": {"enum": [1, 2.5, "a"]}, "minItems": 2, "maxItems": 2},          # mixed enum values
]


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


@pytest.fixture(scope="module")
def reference():
    return ReferenceGPT.from_pretrained(DATA, dtype="float32")


def tokenizer_text() -> str:
    return (DATA / "tokenizer.json").read_text()


def host_greedy(reference, prompt, fmt, n) -> list[int]:
    """What a greedy constrained request must give: each step the reference model's logits, masked by a matcher of
    its own, argmax, until the grammar completes (its end token taken) or n tokens."""
    constraint = Constraint(vocabulary(tokenizer_text(), V, (EOS,)), grammar_of(fmt), V)
    seq, out = list(prompt), []
    for _ in range(n):
        logits = token_bitmask_reference(reference.next_logits([seq]), constraint.mask()[None])
        token = int(np.argmax(logits[0]))
        constraint.accept(token)
        seq.append(token)
        out.append(token)
        if constraint.done or token == EOS:
            break
    return out


def text_of(engine, out) -> str:
    return engine.runner.tokenizer().decode([t for t in out["token_ids"] if t != EOS])


def test_greedy_schemas_validate_and_equal_the_host_loop(reference):
    engine = LLMEngine(reference, max_running=4, token_budget=16, block=4)
    n = 64 - len(PROMPT)
    outs = engine.generate([PROMPT] * len(SCHEMAS), n, sampling=[dict(response_format=schema_format(s))
                                                                 for s in SCHEMAS], temperature=0)
    for schema, out in zip(SCHEMAS, outs):
        assert out["token_ids"] == host_greedy(reference, PROMPT, schema_format(schema), n)
        assert out["finish_reason"] == "stop", (schema, out)
        jsonschema.validate(json.loads(text_of(engine, out)), schema)


def test_sampled_tokens_are_always_allowed_and_complete_outputs_validate(reference):
    engine = LLMEngine(reference, max_running=4, token_budget=16, block=4)
    vocab = vocabulary(tokenizer_text(), V, (EOS,))
    stopped = 0
    for seed in range(6):
        schema = SCHEMAS[seed % len(SCHEMAS)]
        out = engine.generate([PROMPT], 64 - len(PROMPT), response_format=schema_format(schema), temperature=1.5,
                              top_k=0, seed=seed)[0]
        replay = Constraint(vocab, grammar_of(schema_format(schema)), V)
        for token in out["token_ids"]:
            assert allowed_tokens(replay.mask()[None], V)[0, token], (seed, token)
            replay.accept(token)
        if out["finish_reason"] == "stop":
            stopped += 1
            jsonschema.validate(json.loads(text_of(engine, out)), schema)
    assert stopped >= 3


def test_constrained_and_free_requests_share_a_batch(reference):
    free = LLMEngine(reference, max_running=1, token_budget=16, block=4).generate([PROMPT], 12, temperature=0,
                                                                                   ignore_eos=True)[0]
    engine = LLMEngine(reference, max_running=3, token_budget=16, block=4)
    outs = engine.generate([PROMPT, PROMPT, PROMPT], 12, temperature=0, ignore_eos=True,
                           sampling=[{}, dict(response_format={"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"}),
                                     dict(response_format={"type": "choice", "choice": ["yes", "no"]})])
    assert outs[0]["token_ids"] == free["token_ids"]
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text_of(engine, outs[1])) and outs[1]["finish_reason"] == "stop"
    assert text_of(engine, outs[2]) in ("yes", "no") and outs[2]["finish_reason"] == "stop"


def test_a_grammar_that_cannot_finish_in_time_ends_with_length(reference):
    engine = LLMEngine(reference, max_running=2, token_budget=16, block=4)
    out = engine.generate([PROMPT], 3, response_format={"type": "regex", "regex": "[0-9]{40}"}, temperature=0)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 3
    assert text_of(engine, out).isdigit()


@pytest.mark.parametrize("fmt,message", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "response_format: .*nonsense"),
    ({"type": "json_schema", "json_schema": {}}, r"response_format.json_schema.schema must be"),
    ({"type": "regex", "regex": "([a-"}, "response_format: .*regex"),
    ({"type": "grammar", "grammar": "start: missing_rule"}, "response_format: .*missing_rule"),
    ({"type": "choice", "choice": []}, "response_format.choice must be"),
    ({"type": "xml"}, "response_format.type must be one of"),
    ("json", "response_format must be an object"),
])
def test_bad_formats_name_response_format(reference, fmt, message):
    engine = LLMEngine(reference, max_running=2, token_budget=16, block=4)
    with pytest.raises(ValueError, match=message):
        engine.add_request(PROMPT, 5, response_format=fmt)
    assert not engine.has_unfinished


def test_a_gbnf_grammar_is_read_as_lark(reference):
    engine = LLMEngine(reference, max_running=2, token_budget=16, block=4)
    out = engine.generate([PROMPT], 20, response_format={"type": "grammar", "grammar": 'root ::= "x" [0-9] [0-9] "y"'},
                          temperature=0)[0]
    assert re.fullmatch("x[0-9]{2}y", text_of(engine, out)) and out["finish_reason"] == "stop"


def test_the_paged_executor_masks_its_rows(cpu, reference, monkeypatch):
    """The PagedExecutor's own step code (NumPy stand-ins for its kernels): constrained greedy rows equal the host
    loop, a free row in the same steps equals its free run; masks are made ahead on the host thread."""
    from tests.engine.test_paged import PagedKernels
    from tilekit.engine import paged
    from tilekit.models import GPT
    model = GPT.from_pretrained(DATA, dtype="float32")
    engine = LLMEngine(model, max_running=3, token_budget=40, block=16, num_blocks=12, max_len=64, use_graphs=False)
    fmt = schema_format(SCHEMAS[0])
    forwards_at_fill = []
    fill = paged.fill_masks

    def recording_fill(pairs, out):
        forwards_at_fill.append((PagedKernels.calls["decode"] + PagedKernels.calls["prefill"],
                                 threading.current_thread().name.startswith("tilekit-grammar")))
        fill(pairs, out)
    monkeypatch.setattr(paged, "fill_masks", recording_fill)
    before = PagedKernels.calls["decode"] + PagedKernels.calls["prefill"]
    outs = engine.generate([PROMPT, PROMPT], 30, sampling=[dict(response_format=fmt), {}], temperature=0,
                           ignore_eos=True)
    # the first mask made in its step, once the forward is queued; each later one on the host thread from the moment
    # the previous token was taken (prepare_masks), one a pick, none made twice
    assert forwards_at_fill and forwards_at_fill[0] == (forwards_at_fill[0][0], False) and forwards_at_fill[0][0] > before
    assert [on_thread for _, on_thread in forwards_at_fill[1:]] == [True] * (len(outs[0]["token_ids"]) - 1)
    assert outs[0]["token_ids"] == host_greedy(reference, PROMPT, fmt, 30)
    free = [int(t) for t in reference.generate([PROMPT], 30, temperature=0, eos_token_id=[])[0][len(PROMPT):]]
    assert outs[1]["token_ids"] == free
    jsonschema.validate(json.loads(text_of(engine, outs[0])), SCHEMAS[0])


def test_generate_and_generate_text_take_a_response_format(reference):
    """generate() of the NumPy reference (the recompute runner): each row its own matcher, equal to the host loop;
    generate_text's text validates; rows stop when their grammar completes (no eos ids given)."""
    fmt = schema_format(SCHEMAS[1])
    seqs = reference.generate([PROMPT, PROMPT[:2]], 40, temperature=0, response_format=fmt)
    for prompt, seq in zip([PROMPT, PROMPT[:2]], seqs):
        assert [int(t) for t in seq[len(prompt):]] == host_greedy(reference, prompt, fmt, 40)
    text = reference.generate_text("The answer:", 40, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(text), SCHEMAS[1])
    rows = reference.generate([PROMPT, PROMPT[:1]], 12, temperature=0, eos_token_id=[],
                              response_format={"type": "choice", "choice": ["no", "nope"]})
    for prompt, seq in zip([PROMPT, PROMPT[:1]], rows):
        assert reference.runner.tokenizer().decode([int(t) for t in seq[len(prompt):]]) in ("no", "nope")
    with pytest.raises(ValueError, match="response_format.regex must be"):
        reference.generate([PROMPT], 5, response_format={"type": "regex", "regex": ""})


def test_a_failing_matcher_ends_its_request_alone(reference, monkeypatch):
    """A matcher that refuses a token (a parser limit reached) ends that request with "abort"; the engine and the
    other requests go on; a grammar whose only token is banned (min_new_tokens) takes its end instead of crashing."""
    engine = LLMEngine(reference, max_running=3, token_budget=16, block=4)
    free = LLMEngine(reference, max_running=1, token_budget=16, block=4).generate([PROMPT], 8, temperature=0,
                                                                                   ignore_eos=True)[0]
    doomed = engine.add_request(PROMPT, 20, temperature=0, response_format=schema_format(SCHEMAS[2]))
    ended = engine.add_request(PROMPT, 20, temperature=0, min_new_tokens=5,
                               response_format={"type": "regex", "regex": "()"})
    plain = engine.add_request(PROMPT, 8, temperature=0, ignore_eos=True)
    calls = {"n": 0}
    from tilekit.engine import llm
    accept_tokens = llm.accept_tokens

    def refuse_the_third(pairs):
        verdicts = accept_tokens(pairs)
        for i, (constraint, _) in enumerate(pairs):
            if constraint is doomed.constraint:
                calls["n"] += 1
                if calls["n"] == 3:
                    verdicts[i] = False
        return verdicts
    monkeypatch.setattr(llm, "accept_tokens", refuse_the_third)
    while engine.has_unfinished:
        engine.step()
    assert doomed.finish_reason == "abort" and len(doomed.output) == 3
    assert ended.finish_reason == "stop" and ended.output == [EOS]
    assert plain.output == free["token_ids"] and plain.finish_reason == "length"


def test_a_boolean_schema():
    assert grammar_of({"type": "json_schema", "json_schema": {"schema": True}}) is not None
    with pytest.raises(ValueError, match="schema must be a JSON schema"):
        grammar_of({"type": "json_schema", "json_schema": {"schema": False}})


def test_the_paged_executor_lets_a_complete_grammar_end_below_min_new_tokens(cpu):
    from tilekit.models import GPT
    model = GPT.from_pretrained(DATA, dtype="float32")
    engine = LLMEngine(model, max_running=2, token_budget=40, block=16, num_blocks=12, max_len=64, use_graphs=False)
    out = engine.generate([PROMPT, PROMPT], 6, sampling=[dict(response_format={"type": "regex", "regex": "()"}),
                                                         dict(response_format={"type": "regex", "regex": "a"})],
                          temperature=0, min_new_tokens=3)
    assert out[0]["token_ids"] == [EOS] and out[0]["finish_reason"] == "stop"
    assert text_of(engine, out[1]) == "a" and out[1]["finish_reason"] == "stop"


def test_generates_masks_allow_everything_in_stopped_rows_and_every_row_may_stop():
    """generate()'s masks each step: a running row its matcher's, a stopped row all ones; once every row has
    stopped (its grammar complete, or max_new_tokens reached) there is nothing to compute and no error."""
    vocab = vocabulary(tokenizer_text(), V, (EOS,))
    rows = [Constraint(vocab, grammar_of(schema_format(s)), V) for s in SCHEMAS[:3]]
    masks = constraint_masks(rows, np.array([False, True, False]))
    assert (masks[0] == rows[0].mask()).all() and (masks[2] == rows[2].mask()).all()
    assert (masks[1] == -1).all() and not (masks[0] == -1).all()
    assert (constraint_masks(rows, np.ones(3, bool)) == -1).all()


def test_ends_only_is_the_set_of_allowed_ids_within_the_end_tokens():
    rng = np.random.default_rng(0)
    for V, eos in ((1031, (1030,)), (128256, (0,)), (128256, (128001, 128009)), (64, (3, 40))):
        words = -(-V // 32)
        cases = [rng.integers(-2**31, 2**31, words, dtype=np.int64).astype(np.int32), np.zeros(words, np.int32)]
        for ids in ((), eos, eos[:1], eos + (5,)):
            row = np.zeros(words, np.int32)
            for t in ids:
                row.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))
            cases.append(row)
        for row in cases:
            allowed = set(np.flatnonzero(allowed_tokens(row[None], 32 * words)[0]).tolist())
            assert ends_only(row, eos) == (bool(allowed) and allowed <= set(eos)), (V, eos, sorted(allowed)[:5])


def test_generate_asks_whether_a_grammar_has_ended_only_of_rows_whose_eos_is_still_banned(monkeypatch):
    """StaticRunner._put_masks: the eos ban (min_new_tokens) holds while the pick's position is below iparams[b, 2];
    a row past it is never asked (at a 128K vocabulary the question cost milliseconds a row, every step), and a
    banned row whose grammar allows only its end has its ban lifted."""
    from tilekit.engine import static
    from tilekit.engine.stops import StopChecker
    from tilekit.engine.sampling import GenerationSettings

    class Upload:
        last = None

        def set(self, x, stream=None):
            self.last = np.array(x)
    vocab = vocabulary(tokenizer_text(), V, (EOS,))
    rows = [Constraint(vocab, grammar_of(schema_format(SCHEMAS[0])), V) for _ in range(3)]
    asked = []
    monkeypatch.setattr(static, "ends_only", lambda mask, eos: asked.append(True) or True)
    lengths = np.array([5, 5, 9])
    iparams = np.zeros((3, 4), np.int32)
    iparams[:, 2] = lengths - 1 + np.array([0, 2, 0])       # min_new_tokens 0, 2, 0
    stops = StopChecker(3, GenerationSettings(max_new_tokens=8))
    state = SimpleNamespace(bitmask=Upload(), iparams=Upload())
    gen = SimpleNamespace(state=state, stream=None, host_bitmask=np.zeros((3, rows[0].words), np.int32))
    gen.set_bitmask = lambda: state.bitmask.set(gen.host_bitmask)
    static.StaticRunner._put_masks(gen, rows, stops, iparams, (EOS,), lengths)
    assert (state.bitmask.last == constraint_masks(rows, stops.done)).all()
    assert len(asked) == 1 and iparams[1, 2] == 0 and state.iparams.last[1, 2] == 0   # row 1 alone: banned, lifted
    stops.lengths[:] = 2
    asked.clear()
    iparams[1, 2] = lengths[1] + 1
    static.StaticRunner._put_masks(gen, rows, stops, iparams, (EOS,), lengths)
    assert not asked                                        # two tokens made: row 1's ban has ended too


def test_accepting_a_batch_of_tokens_in_parallel_equals_one_by_one():
    """accept_tokens (llguidance's parallel consume): the same verdicts and the same matcher states as accept()
    called row by row, a token outside a row's mask refused in that row alone."""
    vocab = vocabulary(tokenizer_text(), V, (EOS,))
    formats = [schema_format(s) for s in SCHEMAS] * 2
    together = [Constraint(vocab, grammar_of(f), V) for f in formats]
    alone = [c.copy() for c in together]
    rng = np.random.default_rng(0)
    for step in range(12):
        running = [i for i, c in enumerate(alone) if not c.done]
        if not running:
            break
        picks = []
        for i in running:
            allowed = np.flatnonzero(allowed_tokens(alone[i].mask()[None], V)[0])
            refused = step == 5 and i == running[0]
            picks.append(int(rng.choice(np.setdiff1d(np.arange(V), allowed))) if refused else int(rng.choice(allowed)))
        verdicts = accept_tokens([(together[i], t) for i, t in zip(running, picks)])
        assert verdicts == [alone[i].accept(t) for i, t in zip(running, picks)]
        assert not all(verdicts) if step == 5 else all(verdicts)
        for i in running:
            assert together[i].done == alone[i].done
            if not alone[i].done:
                assert (together[i].mask() == alone[i].mask()).all()


@pytest.mark.parametrize("num_blocks", [12, 3])
def test_masks_made_ahead_follow_their_requests_through_reused_slots_and_preemption(cpu, reference, num_blocks):
    """Two slots, five requests (constrained and free, ragged lengths): slots pass from request to request and, with
    3 blocks, requests are preempted and resumed; a mask prepared for a slot's previous holder is never applied to
    the next, so every constrained output equals the host loop and every free one its free run."""
    from tilekit.models import GPT
    model = GPT.from_pretrained(DATA, dtype="float32")
    engine = LLMEngine(model, max_running=2, token_budget=40, block=16, num_blocks=num_blocks, max_len=64,
                       use_graphs=False)
    formats = [schema_format(SCHEMAS[0]), None, schema_format(SCHEMAS[2]), None, schema_format(SCHEMAS[1])]
    prompts = [PROMPT, PROMPT[:2], [11, 12, 13, 14, 15], [290], PROMPT[::-1]]
    outs = engine.generate(prompts, 24, sampling=[dict(response_format=f) if f else dict(ignore_eos=True)
                                                  for f in formats], temperature=0)
    for prompt, fmt, out in zip(prompts, formats, outs):
        if fmt is None:
            free = reference.generate([prompt], 24, temperature=0, eos_token_id=[])[0][len(prompt):]
            assert out["token_ids"] == [int(t) for t in free]
        else:
            assert out["token_ids"] == host_greedy(reference, prompt, fmt, 24)
    if num_blocks == 3:
        assert engine.counters["preemptions"] > 0


def test_one_constraint_constrains_one_running_request(reference):
    engine = LLMEngine(reference, max_running=2, token_budget=16, block=4)
    constraint = engine.runner.constraint(schema_format(SCHEMAS[0]))
    engine.add_request(PROMPT, 8, temperature=0, response_format=constraint)
    with pytest.raises(ValueError, match="response_format: this Constraint already constrains"):
        engine.add_request(PROMPT, 8, temperature=0, response_format=constraint)
    second = engine.add_request(PROMPT, 8, temperature=0, response_format=constraint.copy())
    while engine.has_unfinished:
        engine.step()
    assert second.output == host_greedy(reference, PROMPT, schema_format(SCHEMAS[0]), 8)

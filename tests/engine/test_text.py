"""tilekit.engine.text: tokenizer files, exact incremental detokenization, chat templates.

Tokenizers are built here with `tokenizers` (no network): a byte-level BPE (GPT-2 / Llama-3 style), a
SentencePiece-style BPE with byte fallback (Llama-2 style: "▁" for spaces, <0xXX> byte tokens, one leading space
stripped) and a Metaspace one, each trained on text with accents, CJK and emoji so that characters span tokens.
"""

import functools
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tests._threads import run_briefly
from tilekit.checkpoints import Checkpoint
from tilekit.engine.text import ChatTemplate, TextStream, chat_template, load_tokenizer, render_chat, special_tokens

CORPUS = ["Héllo wörld, ça va? Ünïcödé façade naïve résumé crème brûlée",
          "東京は日本の首都です。中文字符测试，你好世界",
          "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
          "The quick brown fox jumps over the lazy dog. 1234567890"] * 30
ALPHABET = "abcdé ñüçÀ東京字中😀🎉👍🏽\u200d\n.,!?-0123456789"
SPECIALS = ["<|endoftext|>", "<|eot_id|>"]


@functools.cache
def byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@functools.cache
def sentencepiece_like() -> Tokenizer:
    """Llama-2's layout: trained on the Latin text only, so CJK and emoji fall back to <0xXX> byte tokens."""
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.train_from_iterator([CORPUS[0], CORPUS[3]] * 10,
                             trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"],
                                                 show_progress=False))
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


@functools.cache
def metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    return tok


TOKENIZERS = {"byte_level": byte_level, "sentencepiece": sentencepiece_like, "metaspace": metaspace}


# -- loading ------------------------------------------------------------------------------------------

def test_tokenizer_json_loads(tmp_path):
    byte_level().save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    text = "Héllo 東京 😀"
    assert tok.encode(text).ids == byte_level().encode(text).ids
    assert tok.decode(tok.encode(text).ids) == text


def test_a_files_truncation_and_padding_are_not_applied(tmp_path):
    tok = Tokenizer.from_str(byte_level().to_str())
    tok.enable_truncation(max_length=3)
    tok.enable_padding(length=64)
    tok.save(str(tmp_path / "tokenizer.json"))
    text = "The quick brown fox jumps over the lazy dog"
    assert load_tokenizer(tmp_path).encode(text).ids == byte_level().encode(text).ids


def test_vocab_and_merges_load_as_gpt2_with_its_special_tokens(tmp_path):
    byte_level().model.save(str(tmp_path))                 # vocab.json + merges.txt
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>", "special": True}, "bos_token": "<|endoftext|>",
         "unk_token": None, "pad_token": "<not in the vocabulary>"}))
    tok = load_tokenizer(tmp_path)
    eot = byte_level().token_to_id("<|endoftext|>")
    ids = tok.encode("ab<|endoftext|>ça").ids
    assert eot in ids and tok.decode(ids) == "abça" and tok.decode(ids, skip_special_tokens=False) == \
        "ab<|endoftext|>ça"
    assert tok.token_to_id("<not in the vocabulary>") is None
    assert special_tokens(tmp_path) == {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
                                        "pad_token": "<not in the vocabulary>"}


def test_special_tokens_are_checked(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": 5}}))
    with pytest.raises(ValueError, match="tokenizer_config.json: eos_token must be a string"):
        special_tokens(tmp_path)
    assert special_tokens(tmp_path / "nothing-here") == {}


@pytest.mark.parametrize("name,content", [
    ("tokenizer.json", b"not json"), ("tokenizer.json", b'{"model": {"type": "BPE", "vocab": 5}}'),
    ("tokenizer.json", b"\xff\xfe garbage"), ("tokenizer.json", b'{"version": "1.0", "model": {"type": "\x1b[2J"}}'),
    ("vocab.json", b"[1, 2]"), ("merges.txt", b"#version: 0.2\nx y z w\n"),
])
def test_garbage_tokenizer_files_are_value_errors_naming_the_file(tmp_path, name, content):
    if name != "tokenizer.json":
        byte_level().model.save(str(tmp_path))
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as e:
        load_tokenizer(tmp_path)
    assert "\x1b" not in str(e.value)


def test_hostile_tokenizer_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    path = ckpt / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or vocab.json"):
        load_tokenizer(ckpt)
    with open(path, "wb") as f:
        f.truncate((64 << 20) + 1)
    with pytest.raises(ValueError, match="larger than"):
        load_tokenizer(ckpt)
    path.unlink()
    os.mkfifo(path)
    error = run_briefly(lambda: load_tokenizer(ckpt))
    assert isinstance(error, ValueError) and "not a regular file" in str(error)
    path.unlink()
    byte_level().save(str(tmp_path / "outside.json"))
    path.symlink_to(tmp_path / "outside.json")
    outside = f"tokenizer.json: resolves to {tmp_path}/outside.json, outside {ckpt}"
    with pytest.raises(ValueError, match=outside):
        load_tokenizer(ckpt)
    path.unlink()
    (ckpt / "sub").mkdir()
    path.symlink_to("sub/../../outside.json")
    with pytest.raises(ValueError, match=outside):
        load_tokenizer(ckpt)
    path.unlink()
    path.symlink_to(path)                               # a loop
    with pytest.raises(ValueError, match="tokenizer.json: cannot be opened"):
        load_tokenizer(ckpt)
    path.unlink()
    os.symlink("/dev/zero", path)
    with pytest.raises(ValueError, match=f"tokenizer.json: resolves to /dev/zero, outside {ckpt}"):
        load_tokenizer(ckpt)


def test_checkpoint_files_refuse_devices_inside_a_directory(tmp_path):
    """A device node that resolves inside the bound: refused by stat, never opened."""
    error = run_briefly(lambda: Checkpoint.at("/dev").read_text("zero", 1 << 20))
    assert isinstance(error, ValueError) and "not a regular file" in str(error)
    assert not Checkpoint.at(tmp_path).has("absent.json")


# -- incremental detokenization ----------------------------------------------------------------------

def stream(tok, ids, skip, context=()):
    s = TextStream(tok, skip_special_tokens=skip, context=context)
    pieces = [s.push(i) for i in ids]
    return pieces, s.flush()


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_stream_concatenates_to_the_whole_decode_for_any_ids(name, data, skip):
    tok = TOKENIZERS[name]()
    V = tok.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, V - 1), max_size=40))
    pieces, rest = stream(tok, ids, skip)
    assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=100, deadline=None)
@given(text=st.text(ALPHABET, min_size=1, max_size=40), cut=st.integers(0, 40))
def test_stream_never_prints_a_split_character(name, text, cut):
    """Text that encodes characters over several tokens prints them whole: no U+FFFD in any piece, with or
    without the prompt's ids as context."""
    tok = TOKENIZERS[name]()
    ids = tok.encode(text).ids
    for context, rest_ids in (((), ids), (ids[:cut], ids[cut:])):
        pieces, rest = stream(tok, rest_ids, True, context)
        assert not any("\ufffd" in p for p in pieces + [rest])
        whole, before = tok.decode(list(context) + rest_ids), tok.decode(list(context))
        assert "".join(pieces) + rest == whole[len(before):]
        assert rest == "" or name == "sentencepiece"        # there, a trailing run of byte tokens waits for flush
    if name == "byte_level":
        assert "".join(stream(tok, ids, True)[0]) == text


def test_stream_holds_a_character_until_its_last_byte():
    tok = byte_level()
    ids = [tok.token_to_id(c) for c in ("ð", "Ł", "ĺ", "Ģ")]    # the byte-level symbols of 😀's four bytes
    s = TextStream(tok)
    assert [s.push(i) for i in ids] == ["", "", "", "😀"]
    assert s.flush() == ""
    s = TextStream(tok)
    assert [s.push(i) for i in ids[:2]] == ["", ""]
    assert s.flush() == "\ufffd"                                 # an unfinished character, as decode() gives it


def test_context_keeps_the_leading_space_a_sentencepiece_decode_drops():
    tok = sentencepiece_like()
    prompt, continuation = tok.encode("Hello").ids, tok.encode(" world").ids[1:]   # ids of "▁world" ...
    alone, rest = stream(tok, continuation, True)
    assert "".join(alone) + rest == tok.decode(continuation) and not tok.decode(continuation).startswith(" ")
    pieces, rest = stream(tok, continuation, True, context=prompt)
    assert "".join(pieces) + rest == tok.decode(prompt + continuation)[len(tok.decode(prompt)):]
    assert "".join(pieces).startswith(" ")


# -- chat templates -----------------------------------------------------------------------------------

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# trim_blocks / lstrip_blocks, loop controls, HF's tojson, {% generation %}, raise_exception
FEATURES = """{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    {% if message['role'] == 'tool' %}{{ raise_exception('no tools here: ' + message['content']) }}{% endif %}
    <{{ message['role'] }}> {{ message['content'] | tojson }}
    {% if message['role'] == 'assistant' %}{% generation %}[{{ message['content'] }}]{% endgeneration %}{% endif %}
    {% if loop.index >= 3 %}{% break %}{% endif %}
{% endfor %}
{{ {'b': 'é<&>', 'a': [1]} | tojson(indent=1, sort_keys=True) }}"""
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Héllo, 東京? 😀 "},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "<b>\"q\"</b>"}]


def test_llama3_template():
    got = render_chat(LLAMA3, CONVERSATION, {"bos_token": "<|begin_of_text|>"})
    assert got == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nHéllo, 東京? 😀<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\nHi!<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\n<b>\"q\"</b><|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not render_chat(LLAMA3, CONVERSATION[:2], {"bos_token": "<s>"}, add_generation_prompt=False) \
        .endswith("assistant<|end_header_id|>\n\n")


def test_chatml_template():
    assert render_chat(CHATML, CONVERSATION[1:3]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n Héllo, 東京? 😀 <|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_template_features_as_transformers_renders_them():
    assert render_chat(FEATURES, CONVERSATION) == (
        '    <user> " Héllo, 東京? 😀 "\n'
        '    <assistant> "Hi!"\n'
        '[Hi!]'
        '{\n "a": [\n  1\n ],\n "b": "é<&>"\n}')
    with pytest.raises(ValueError, match="chat template fails to render: no tools here: x"):
        render_chat(FEATURES, [{"role": "tool", "content": "x"}])


def test_strftime_now_and_special_token_variables():
    got = render_chat("{{ strftime_now('%Y') }} {{ eos_token }} {{ pad_token is defined }}", CONVERSATION,
                      {"eos_token": "</s>"})
    year, eos, pad = got.split(" ")
    assert year.isdigit() and len(year) == 4 and eos == "</s>" and pad == "False"


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"), ("hello", "non-empty list"), ([{"role": "user"}], r"messages\[0\] must be an object"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}],
     r"messages\[1\] has an unknown role 'wizard'"),
    ([{"role": "\x1b[2J", "content": "b"}], r"unknown role '\\x1b\[2J'"),
    ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a string"),
])
def test_bad_messages_are_refused(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(CHATML, messages)


@pytest.mark.parametrize("template,match", [
    ("{% for m in messages %}", "fails to render"),                       # syntax
    ("{{ raise_exception('Conversation roles must alternate') }}", "Conversation roles must alternate"),
    ("{{ messages[0].content.__class__.__mro__ }}", "fails to render"),    # the sandbox
    ("{{ messages.append(1) }}", "fails to render"),                      # immutable
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    ("{{ undefined_function() }}", "fails to render"),
    ("{% for i in range(10 ** 9) %}{% endfor %}", "fails to render"),     # the sandbox's range limit
])
def test_failing_templates_are_value_errors_naming_the_source(template, match):
    with pytest.raises(ValueError, match=match) as e:
        render_chat(template, CONVERSATION, source="/ckpt/tokenizer_config.json: chat_template")
    assert str(e.value).startswith("/ckpt/tokenizer_config.json: chat_template")


@pytest.mark.parametrize("template, problem", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "the template makes more than 262144 loop iterations and calls"),
    ("{% set s = 'ab' * 1000 %}{% for a in s %}{% for b in s %}{% for c in s %}{% endfor %}{% endfor %}{% endfor %}",
     "the template makes more than 262144 loop iterations and calls"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     "the template makes more than 262144 loop iterations and calls"),
    ("{{ 'ab' * 16777216 }}", "'*' would make 2 x 16777216 items, more than 16777216"),
    ("{{ (2 ** 33554432) > 1 }}", "'**' would make an integer of more than 16777216 bits"),
    # list concatenation by sum: 4000 copies of a growing list, quadratic (minutes)
    ("{% set a = [[1] * 4000] * 4000 %}{% set b = a|sum(start=[]) %}",
     "the filter sum adds numbers only (its start is not one)"),
    # lazy filters nested: millions of one-item lists (gigabytes) behind one top-level length
    ("{% set a = ('x' * 4000000)|batch(1)|batch(1)|batch(1)|batch(1)|batch(1)|batch(1)|list %}",
     "the template makes more than 262144 loop iterations and calls"),
])
def test_templates_that_would_run_for_hours_or_fill_memory_are_refused(template, problem):
    error = run_briefly(lambda: render_chat(template, CONVERSATION, source="chat_template.jinja"), seconds=20)
    assert type(error) is ValueError and str(error) == f"chat_template.jinja fails to render: {problem}"


BIG = "{% set a = 'x' * 16777216 %}"


@pytest.mark.parametrize("template, problem", [
    (BIG + "{{ a ~ a }}", "'~' would make 33554432 items, more than 16777216"),
    (BIG + "{% set b = a ~ 'y' %}", "'~' would make 16777217 items, more than 16777216"),
    (BIG + "{{ a + a }}", "'+' would make 33554432 items, more than 16777216"),
    ("{{ ('a' * 10000)|replace('a', 'b' * 10000) }}", "replace would make 100000000 items, more than 16777216"),
    ("{{ ('a' * 10000).replace('a', 'b' * 10000) }}", "replace would make 100000000 items, more than 16777216"),
    ("{{ (['a'] * 10000)|join('x' * 10000) }}", "join would make 100000000 items, more than 16777216"),
    ("{{ ('x' * 10000).join(['a'] * 10000) }}", "join would make 100000000 items, more than 16777216"),
    ("{{ ('x' * 10000).join(range(10000)|map('string')) }}", "join would make 100028890 items, more than 16777216"),
    ("{{ '%99999999999s' % 'a' }}", "'%' has a width or precision past 16777216"),
    ("{{ '%.99999999999f' % 1.5 }}", "'%' has a width or precision past 16777216"),
    ("{{ '%*s' % (1000000000, 'a') }}", "'%' takes an integer past 16777216"),
    ("{{ '{:>99999999999}'.format('a') }}", "the call format() has a width or precision past 16777216"),
    ("{{ 'a'.center(10 ** 9) }}", "the call center() takes an integer past 16777216"),
    ("{{ 'a'|center(10 ** 9) }}", "the filter center takes an integer past 16777216"),
    ("{{ '%99999999999s'|format('a') }}", "the filter format has a width or precision past 16777216"),
    ("{{ 'a'|indent(10 ** 9, true) }}", "the filter indent takes an integer past 16777216"),
    ("".join(f"{{% set v{i} = 'x' * 16000000 %}}" for i in range(10)), "the template makes more than 134217728 items"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
     "the template's output would make 16778000 items, more than 16777216"),
    # values that hold the same big string many times: rendered whole, they would take gigabytes
    ("{% set s = 'x' * 16000000 %}{{ ([[s] * 16] * 16)|tojson|length }}",
     "the filter tojson would render a value of more than 16777216 items"),
    ("{% set s = 'x' * 16000000 %}{{ ([s] * 4)|string|length }}",
     "the filter string would render a value of more than 16777216 items"),
    ("{% set s = 'x' * 16000000 %}{{ [[s] * 16] * 4 }}",
     "the template's output would render a value of more than 16777216 items"),
    ("{% set s = 'x' * 16000000 %}{{ ([s] * 4) ~ '' }}",
     "the template's output would render a value of more than 16777216 items"),
    ("{% set t = [[[[[[1] * 16] * 16] * 16] * 16] * 16] %}{{ t|tojson|length }}",
     "the filter tojson would render a value of more than 262144 nested items"),
    ("{{ ('a\\n' * 1000)|indent(16000000) }}", "indent would make 16016002000 items, more than 16777216"),
    ("{{ ('a\\n' * 100000)|indent('x' * 1000) }}", "indent would make 100201000 items, more than 16777216"),
    ("{{ ('\\t' * 1000).expandtabs(16000000) }}", "expandtabs would make 16016001000 items, more than 16777216"),
    ("{{ 'x'|center(1000000)|wordwrap(1) }}", "the filter wordwrap takes at most 32768 characters"),
    ("{{ ([[[1] * 40] * 40] * 40)|tojson(indent=1000000) }}",
     "the filter tojson would render a value of more than 16777216 items"),
])
def test_templates_that_would_build_huge_values_are_refused_before_they_do(template, problem):
    error = run_briefly(lambda: render_chat(template, CONVERSATION, source="chat_template.jinja"), seconds=20)
    assert type(error) is ValueError and str(error).startswith(f"chat_template.jinja fails to render: {problem}")


def test_the_size_bounds_keep_jinjas_results():
    cases = {"{{ 'a' ~ 1 ~ none ~ [2] }}": "a1None[2]", "{{ 'ab' + 'c' }}{{ [1] + [2] }}{{ 2 + 3 }}": "abc[1, 2]5",
             "{{ '%5s|%-4d|%.2f' % ('a', 7, 1.005) }}": "    a|7   |1.00", "{{ '{:>4}'.format('b') }}": "   b",
             "{{ 'aXa'|replace('a', 'bb') }}{{ 'x'.join(['1', '2']) }}{{ [1, 2]|join('-') }}": "bbXbb1x21-2",
             "{{ 'ab'|center(6) }}|{{ '%s'|format('q') }}|{{ 'xy'.center(4, '*') }}": "  ab  |q|*xy*",
             "{% set s %}{{ 'a' ~ 'b' }}{% endset %}{{ s ~ s|upper }}": "abAB",
             "{{ ['a', 'b']|map('upper')|join('-') }}|{{ messages|map(attribute='role')|join }}": "A-B|systemuserassistantuser",
             "{{ '+'.join(['a', 'b']|map('upper')) }}{{ [{'n': 'x'}, {'n': 'y'}]|join(',', attribute='n') }}": "A+Bx,y",
             "{{ 'a\\nb'|indent(2, first=true) }}|{{ 'a\\nb'|indent('> ') }}|{{ 'a\\tb'.expandtabs(4) }}":
                 "  a\n  b|a\n> b|a   b",
             "{{ {'k': [1, none, 'v']}|tojson }}|{{ [1, 'a']|string }}|{{ 'aa bb'|wordwrap(3) }}":
                 '{"k": [1, null, "v"]}|[1, \'a\']|aa\nbb',
             "{{ [1]|tojson(indent=2) }}": "[\n  1\n]",
             "{{ [1, 2.5]|sum }}|{{ [1, 2, 3, 4]|batch(3)|list }}|{{ [3, 1, 2]|sort|reverse|join }}":
                 "3.5|[[1, 2, 3], [4]]|321"}
    for template, want in cases.items():
        assert render_chat(template, CONVERSATION) == want, template


def test_the_bounds_leave_real_templates_alone():
    looped = "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ m.role * 2 }}{% else %}none{% endfor %}"
    assert render_chat(looped + "{{ 2 ** 10 }}", CONVERSATION[:1]) == "1/1 systemsystem1024"
    assert render_chat("{% for m in messages %}{% endfor %}{% for x in [] %}{% else %}none{% endfor %}",
                       CONVERSATION) == "none"


def test_template_size_is_bounded():
    with pytest.raises(ValueError, match="at most"):
        render_chat("x" * ((1 << 20) + 1), CONVERSATION)


def test_chat_template_is_found_as_transformers_finds_it(tmp_path):
    assert chat_template(tmp_path) is None
    config = {"bos_token": {"content": "<|begin_of_text|>", "lstrip": False}, "chat_template": LLAMA3}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = chat_template(tmp_path)
    assert t == ChatTemplate(LLAMA3, f"{tmp_path / 'tokenizer_config.json'}: chat_template",
                             {"bos_token": "<|begin_of_text|>"})
    assert t.render(CONVERSATION[1:2]).startswith("<|begin_of_text|><|start_header_id|>user")
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": CHATML}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat_template(tmp_path).text == CHATML
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}jinja file wins")
    t = chat_template(tmp_path)
    assert t.source == str(tmp_path / "chat_template.jinja") and t.render(CONVERSATION) == \
        "<|begin_of_text|>jinja file wins"


@pytest.mark.parametrize("value,match", [
    ([{"name": "tool_use", "template": "T"}], "no 'default' template"), ([{"name": "default"}], "a list of"),
    (["x"], "a list of"), (5, "must be a string"), ("x" * ((1 << 20) + 1), "longer than"),
])
def test_bad_chat_template_entries(tmp_path, value, match):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
    with pytest.raises(ValueError, match=match) as e:
        chat_template(tmp_path)
    assert "tokenizer_config.json: chat_template" in str(e.value)


def test_hostile_chat_template_files(tmp_path):
    path = tmp_path / "chat_template.jinja"
    path.write_bytes(b"{{ 1 }}\xff")
    with pytest.raises(ValueError, match="chat_template.jinja: is not UTF-8"):
        chat_template(tmp_path)
    path.unlink()
    with open(path, "wb") as f:
        f.truncate((1 << 20) + 1)
    with pytest.raises(ValueError, match="larger than"):
        chat_template(tmp_path)
    path.unlink()
    os.mkfifo(path)
    error = run_briefly(lambda: chat_template(tmp_path))
    assert isinstance(error, ValueError) and "not a regular file" in str(error)
    path.unlink()
    path.write_text("{{ raise_exception('bad') }}")
    with pytest.raises(ValueError, match="chat_template.jinja fails to render: bad"):
        chat_template(tmp_path).render(CONVERSATION)

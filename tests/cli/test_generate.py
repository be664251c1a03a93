"""`tilekit generate` and `tilekit chat` on CPU (--device cpu runs the NumPy reference), `--version`, and the
command line's argument checks: each misuse is one `tilekit: ...` line naming the argument, exit 2, before any
model loads."""

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tilekit
from tilekit import cli
from tests.cli.test_cli import misuse, run
from tilekit.models import ReferenceGPT
from tilekit.engine.text import load_tokenizer

TINY = Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny-gpt2"


def test_version(capsys):
    rc, out, _ = run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"tilekit {tilekit.__version__}" and tilekit.__version__


def test_generate_on_the_cpu_is_the_references_greedy_continuation(capsys):
    rc, out, err = run(["generate", "--model", str(TINY), "--prompt", "the quick", "--device", "cpu",
                        "--max-new-tokens", "6", "--temperature", "0"], capsys)
    assert (rc, err) == (0, ""), err
    tokenizer = load_tokenizer(TINY)
    ids = tokenizer.encode("the quick").ids
    greedy = ReferenceGPT.from_pretrained(TINY, dtype=np.float32).generate_greedy(np.array([ids]), 6)[0]
    assert out == "the quick" + tokenizer.decode(greedy[len(ids):].tolist()) + "\n"


def test_a_prompts_file_is_one_batch_printed_as_json_lines(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick\n\nbrown fox jumps\n")
    rc, out, err = run(["generate", "--model", str(TINY), "--prompts-file", str(prompts), "--device", "cpu",
                        "--max-new-tokens", "4", "--temperature", "0.9", "--top-k", "20", "--seed", "3"], capsys)
    assert (rc, err) == (0, ""), err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 2 and all(isinstance(t, str) for t in lines)
    again = run(["generate", "--model", str(TINY), "--prompts-file", str(prompts), "--device", "cpu",
                 "--max-new-tokens", "4", "--temperature", "0.9", "--top-k", "20", "--seed", "3"], capsys)[1]
    assert again == out, "the same seed sampled other tokens"


@pytest.mark.parametrize("args,says", [
    (["--temperature", "nan"], "temperature must be finite"),
    (["--temperature", "-1"], "temperature must be 0 (greedy) or >= 1e-06"),
    (["--temperature", "1e-320"], "temperature must be 0 (greedy) or >= 1e-06"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "-1"], "argument --top-k"),
    (["--min-p", "2"], "min_p must be in [0, 1]"),
    (["--repetition-penalty", "0"], "repetition_penalty must be in [1e-06, 1e+06]"),
    (["--repetition-penalty", "1e-310"], "repetition_penalty must be in [1e-06, 1e+06]"),
    (["--repetition-penalty", "1e300"], "repetition_penalty must be in [1e-06, 1e+06]"),
    (["--frequency-penalty=-1e308"], "frequency_penalty must be in [-1e+06, 1e+06]"),
    (["--presence-penalty", "1e308"], "presence_penalty must be in [-1e+06, 1e+06]"),
    (["--presence-penalty", "inf"], "presence_penalty must be finite"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens"),
    (["--max-new-tokens", "abc"], "argument --max-new-tokens"),
    (["--stop", ""], "stop_strings"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 needs --device cuda"),
    (["--quantize-head"], "--quantize-head needs --device cuda"),
    (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice"),
])
def test_bad_generation_options_are_refused_before_loading(args, says, capsys, monkeypatch):
    from tilekit.models import families
    monkeypatch.setattr(families, "load_reference", lambda *a, **k: pytest.fail("loaded a model"))
    line = misuse(["generate", "--model", str(TINY), "--prompt", "x", "--device", "cpu", *args], capsys)
    assert says in line, line


def test_structured_output_from_the_command_line(tmp_path, capsys):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "yz"]}}, "required": ["k"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    base = ["generate", "--model", str(TINY), "--prompt", "the quick", "--device", "cpu", "--max-new-tokens", "30",
            "--temperature", "0"]
    rc, out, err = run(base + ["--json-schema", str(path)], capsys)
    assert (rc, err) == (0, ""), err
    assert out.startswith("the quick") and json.loads(out[len("the quick"):].strip()) in ({"k": "x"}, {"k": "yz"})
    rc, out, err = run(base + ["--regex", "[0-9]{3}"], capsys)
    assert (rc, err) == (0, "") and out[len("the quick"):].strip().isdigit() and len(out.strip()) == 12, out


@pytest.mark.parametrize("make,says", [
    (lambda d: ["--json-schema", str(d / "nowhere.json")], "cannot read --json-schema"),
    (lambda d: ["--json-schema", str(d / "bad.json")], "is not JSON"),
    (lambda d: ["--json-schema", str(d / "wrong.json")], "response_format.json_schema.schema must be"),
    (lambda d: ["--grammar", str(d / "bad.json")], "bad.json"),
    (lambda d: ["--regex", "a", "--json"], "give one of --json-schema, --json, --regex and --grammar"),
])
def test_bad_structured_output_options_are_refused_before_loading(make, says, tmp_path, capsys, monkeypatch):
    pytest.importorskip("llguidance")
    from tilekit.models import families
    monkeypatch.setattr(families, "load_reference", lambda *a, **k: pytest.fail("loaded a model"))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "wrong.json").write_text("[1, 2]")
    line = misuse(["generate", "--model", str(TINY), "--prompt", "x", "--device", "cpu", *make(tmp_path)], capsys)
    assert says in line, line


def test_generation_options_carry_the_kv_cache_dtype_past_the_settings_check():
    """The options checked before loading keep --kv-cache-dtype for generate() (not a GenerationSettings field)."""
    args = cli.build_parser().parse_args(["generate", "--model", str(TINY), "--prompt", "x", "--device", "cuda",
                                          "--kv-cache-dtype", "fp8", "--seed", "3", "--temperature", "0.5"])
    options = cli.generate._generation_options(args)
    assert (options["kv_cache_dtype"], options["seed"], options["temperature"]) == ("fp8", 3, 0.5)


def test_prompt_choice_and_files_are_checked(tmp_path, capsys):
    base = ["generate", "--model", str(TINY), "--device", "cpu"]
    assert "exactly one of --prompt or --prompts-file" in misuse(base, capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert "holds no prompt" in misuse(base + ["--prompts-file", str(empty)], capsys)
    assert "not a regular file" in misuse(base + ["--prompts-file", "/dev/zero"], capsys)
    assert "cannot read --prompts-file" in misuse(base + ["--prompts-file", str(tmp_path / "none")], capsys)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    assert "not UTF-8" in misuse(base + ["--prompts-file", str(bad)], capsys)


TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"


def test_chat_needs_a_template_and_runs_turns_from_stdin(tmp_path, capsys, monkeypatch):
    checkpoint = tmp_path / "tiny-chat"
    shutil.copytree(TINY, checkpoint)
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nyo\n\n"))
    rc, out, err = run(["chat", "--model", str(checkpoint), "--device", "cpu", "--max-new-tokens", "3",
                        "--temperature", "0", "--system", "x"], capsys)
    assert (rc, err) == (0, ""), err
    assert len(out.splitlines()) == 2, out          # one reply line per user turn


def test_chat_without_a_template_says_so(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    line = misuse(["chat", "--model", str(TINY), "--device", "cpu", "--max-new-tokens", "2"], capsys)
    assert "has no chat template" in line


@pytest.mark.parametrize("shape,says", [
    ("M=-1,N=8,K=8", "M must be an integer in [1, 2147483648], got -1"),
    ("M=abc,N=8,K=8", "M must be an integer in [1, 2147483648], got 'abc'"),
    ("M=\u00b2,N=8,K=8", "M must be an integer in [1, 2147483648], got '\u00b2'"),       # not an ASCII digit
    ("M=\uff11\uff12,N=8,K=8", "M must be an integer in [1, 2147483648], got '\uff11\uff12'"),
    ("M=--5,N=8,K=8", "M must be an integer in [1, 2147483648], got '--5'"),
    ("M=8,N=8,K=" + "1" * 31, "K must be an integer in [1, 2147483648], got " + "1" * 31),
    ("M=8,N=8,K=8,act=relu", "act must be one of none, gelu, got 'relu'"),
    ("M=8,N=8,K=8,dtype=int8", "dtype must be one of bfloat16, float16, float32, got 'int8'"),
])
def test_tune_shapes_are_checked(shape, says, capsys):
    assert says in misuse(["tune", "--kernel", "linear", "--shape", shape], capsys)


@pytest.mark.parametrize("args,says", [
    (["--budget", "0"], "argument --budget"), (["--budget", "nan"], "argument --budget"),
    (["--workers", "0"], "argument --workers"), (["--new-tokens", "-3"], "argument --new-tokens"),
    (["--seq-lens", "0"], "argument --seq-lens"),
])
def test_tune_options_are_checked(args, says, capsys):
    assert says in misuse(["tune", "--model", "gpt2", *args], capsys)


def test_explain_follows_the_autotune_mode(capsys, monkeypatch):
    base = ["db", "explain", "--gpu", "NVIDIA H100 80GB HBM3", "--batch-sizes", "1", "--seq-lens", "128"]
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "off")
    rc, out, _ = run(base, capsys)
    lines = out.splitlines()
    assert rc == 0 and "TILEKIT_AUTOTUNE=off" in lines[0]
    assert all(line.endswith("heuristic default") for line in lines[1:]), lines
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "sometimes")
    assert "TILEKIT_AUTOTUNE='sometimes' is not one of" in misuse(base, capsys)


@pytest.mark.gpu
def test_generate_with_an_fp8_kv_cache_prints_the_models_fp8_continuation(capsys):
    """`--kv-cache-dtype fp8` reaches generate(): greedy text equal to the model's own with kv_cache_dtype="fp8"."""
    from tilekit.models import families
    rc, out, err = run(["generate", "--model", str(TINY), "--prompt", "the quick", "--max-new-tokens", "12",
                        "--temperature", "0", "--dtype", "fp32", "--kv-cache-dtype", "fp8"], capsys)
    assert (rc, err) == (0, ""), err
    model = families.load_model(TINY, dtype="float32")
    expected = model.generate_text("the quick", 12, temperature=0, kv_cache_dtype="fp8")
    assert out == "the quick" + expected + "\n"


def _copy(tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(TINY, d)
    return d


def test_a_tokenizer_that_cannot_encode_or_names_ids_past_the_vocabulary_is_refused(tmp_path, capsys):
    """tokenizer.json is untrusted: an encode error (a Unigram model without unk_id) or an id past config.json's
    vocab_size is one line naming the file, no traceback."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    d = _copy(tmp_path)
    (d / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "Unigram", "unk_id": None, "vocab": [["a", 0.0]]}}))
    rc, _, err = run(["generate", "--model", str(d), "--prompt", "hi zz", "--device", "cpu", "--max-new-tokens", "2"],
                     capsys)
    assert rc == 2 and f"{d / 'tokenizer.json'}: cannot encode the prompt" in err and "Traceback" not in err, err
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5000, "world": 7}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    rc, _, err = run(["generate", "--model", str(d), "--prompt", "hello world", "--device", "cpu",
                      "--max-new-tokens", "2"], capsys)
    assert rc == 2 and "tokenizer.json: makes token id 5000, past the model's vocabulary" in err, err


def test_an_eos_id_past_the_vocabulary_names_its_file(tmp_path, capsys):
    d = _copy(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 999999999}))
    rc, out, err = run(["generate", "--model", str(d), "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "2"],
                       capsys)
    assert rc == 2 and f"{d / 'generation_config.json'}: eos_token_id must lie in [0, " in err, err
    assert out == "", "the prompt was echoed before the checks failed"


def _with_tokenizer(d: Path, change) -> None:
    tok = json.loads((d / "tokenizer.json").read_text())
    change(tok)
    (d / "tokenizer.json").write_text(json.dumps(tok))


@pytest.mark.parametrize("normalizer, says", [
    ({"type": "Precompiled", "precompiled_charsmap": "/////wAAAAA="}, "is not a tokenizer"),     # panics loading
    ({"type": "Precompiled", "precompiled_charsmap": "AAAAAAAA"}, "cannot encode the prompt"),     # ... encoding
    ({"type": "Replace", "pattern": {"Regex": ""}, "content": "xx"}, "cannot encode the prompt")])
def test_a_tokenizer_whose_library_panics_is_one_line_naming_the_file(tmp_path, capsys, normalizer, says):
    """The tokenizers library's Rust panics (pyo3's PanicException, a BaseException) on a stranger's file end as
    the file's error, exit 2, not a traceback."""
    d = _copy(tmp_path)
    _with_tokenizer(d, lambda t: t.update(normalizer=normalizer))
    rc, _, err = run(["generate", "--model", str(d), "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "2"],
                     capsys)
    assert rc == 2 and f"{d / 'tokenizer.json'}: {says}" in err and "Traceback" not in err, err


def test_a_decoder_that_rewrites_printed_text_names_the_tokenizer(tmp_path, capsys):
    """A decoder whose rules reach back across tokens (here: fuse the pieces, then replace 'ih') would make the
    streamed pieces disagree with the whole decode: the file's error, not a RuntimeError traceback."""
    d = _copy(tmp_path)
    _with_tokenizer(d, lambda t: t.update(decoder={"type": "Sequence", "decoders": [
        t["decoder"], {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "ih"}, "content": "X"}]}))
    rc, _, err = run(["generate", "--model", str(d), "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "3"],
                     capsys)
    assert rc == 2 and f"{d / 'tokenizer.json'}: has a decoder that rewrites text already printed" in err, err


def test_a_length_from_generation_config_past_the_context_says_where_it_came_from(tmp_path, capsys):
    d = _copy(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"max_new_tokens": 100000}))
    rc, _, err = run(["generate", "--model", str(d), "--prompt", "hi", "--device", "cpu"], capsys)
    assert rc == 2 and "max_new_tokens 100000 (generation_config.json's) exceeds" in err, err

"""Ctrl-C in `tilekit generate` and `tilekit chat` (the NumPy reference on the CPU, a checkpoint long enough that the
interrupt lands mid-generation) and in `tilekit tune`: one line on stderr, exit status 130; a tune keeps every entry
it measured before the interrupt."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tilekit import cli
from tilekit.models.gpt2 import weights
from tilekit.models.gpt2.config import GPTConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny-gpt2"


@pytest.fixture(scope="module")
def slow_checkpoint(tmp_path_factory):
    """A random GPT-2 with tiny-gpt2's tokenizer and a 1024-token context: the reference recomputes every prefix, so
    hundreds of new tokens take many seconds."""
    directory = tmp_path_factory.mktemp("slow-gpt2")
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=1024, vocab_size=1031, bos_token_id=1030,
                       eos_token_id=1030)
    weights.save_state_dict(directory, config, weights.random_state_dict(config, seed=0))
    shutil.copy(TINY / "tokenizer.json", directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"}))
    return directory


def interrupted(argv, stdin_text=None) -> tuple[int, str]:
    """Run `python -m tilekit argv`, send SIGINT once it has printed something, and return (status, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "tilekit", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    try:
        if stdin_text is not None:
            p.stdin.write(stdin_text.encode())
            p.stdin.flush()
        assert p.stdout.read(1), "the command printed nothing before it ended"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
        p.wait()
    return p.returncode, err.decode()


def test_ctrl_c_in_generate_is_one_line_and_status_130(slow_checkpoint):
    status, err = interrupted(["generate", "--model", str(slow_checkpoint), "--device", "cpu", "--prompt", "the",
                               "--max-new-tokens", "900", "--temperature", "0"])
    assert (status, err) == (130, "tilekit: interrupted\n")


def test_ctrl_c_in_chat_is_one_line_and_status_130(slow_checkpoint):
    status, err = interrupted(["chat", "--model", str(slow_checkpoint), "--device", "cpu", "--max-new-tokens", "900",
                               "--temperature", "0"], stdin_text="hello there\n")
    assert (status, err) == (130, "tilekit: interrupted\n")


def test_an_interrupted_tune_keeps_what_it_measured(monkeypatch, capsys):
    """The tuner stores each shape as it is measured; Ctrl-C while the second is measured keeps the first (exit 130,
    one line saying so). The GPU work is stood in for: the store and the interrupt are real."""
    from tests._autotune_fakes import H100
    from tilekit.autotune import store, tuner
    from tilekit.cli import tune
    stored = []

    def tune_many(items, progress, **_):
        for op, problem in items:
            if stored:
                raise KeyboardInterrupt       # Ctrl-C while the second shape is measured
            config = op.default(op.tuning_problem(problem))
            key = op.problem_key(problem)[1]
            result = tuner.TuneResult(op=op.name, key=key, config=config, time_us=1.5, default_config=config,
                                      default_time_us=1.5, candidates=1, measured=1)
            store.user_db().store(H100, {key: tuner._entry(op, result, H100)})
            stored.append(key)
            progress("tuned", result=result)
    monkeypatch.setattr(tuner, "tune_many", tune_many)
    monkeypatch.setattr(tune, "pending", lambda items, force: (list(items), []))
    monkeypatch.setattr("tilekit.device.device_info", lambda index=None: H100)
    monkeypatch.setattr("tilekit.device.gpu_unavailable_reason", lambda: None)
    assert cli.main(["tune", "--model", "gpt2", "--batch-sizes", "1", "--seq-lens", "64", "--new-tokens", "8"]) == 130
    err = capsys.readouterr().err
    assert err.endswith("interrupted: 1 results were stored; run the command again to continue\n"), err
    store.reset()
    entries = store.user_db().file_for(H100).read()
    assert list(entries) == stored and len(stored) == 1 and entries[stored[0]]["time_us"] == 1.5

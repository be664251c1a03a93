"""How a process that ran a model ends, on the GPU (issue #59): each way of ending runs in a fresh subprocess, whose
exit status is the one its ending gives and whose stderr holds no "Fatal Python error" (a segmentation fault at
interpreter shutdown printed one, exit status 139). Ctrl-C inside prefill and inside decode leaves the model usable:
the next call's greedy tokens are those of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"gpt2": ROOT / "tests" / "data" / "tiny-gpt2", "llama": ROOT / "tests" / "data" / "tiny-llama",
          "deepseek-v2": ROOT / "tests" / "data" / "tiny-deepseek-v2"}

PROLOGUE = """
import gc, os, signal, sys, threading
import numpy as np
from tilekit.models import load_model
model = load_model({model!r}, dtype="float32")
ids = (np.arange(1, 9, dtype=np.int64)[None] * 7) % model.config.vocab_size
"""

# ending -> (the script's end, the exit status it must give)
ENDINGS = {
    "forward": ("print(float(model(ids).sum()))", 0),
    "generate": ("print(model.generate(ids, 8)[0][-3:])", 0),
    "sampled": ("print(model.generate(ids, 8, temperature=0.8, top_k=20, seed=1)[0][-3:])", 0),
    "eager": ("print(model.generate(ids, 8, use_graph=False)[0][-3:])", 0),
    "sys-exit": ("model.generate(ids, 8)\nsys.exit(3)", 3),
    "exception": ("model.generate(ids, 8)\nraise RuntimeError('escaping')", 1),
    "keyboard-interrupt": ("model.generate(ids, 8)\nraise KeyboardInterrupt", -signal.SIGINT),
    "two-models": ("other = load_model(os.environ['MODEL'], dtype='float32')\nmodel.generate(ids, 8)\n"
                   "other.generate(ids, 4)\nprint(float(other(ids).sum()))", 0),
    "thread": ("t = threading.Thread(target=lambda: model.generate(ids, 8))\nt.start()\nt.join()", 0),
    "after-release": ("model.generate(ids, 8)\nmodel.forget_graphs()\nmodel(ids)", 0),
}

# Ctrl-C raised inside a call (as the signal handler raises it, between two kernel launches), then the same model
# generates again: its tokens must equal the uninterrupted run's.
INTERRUPTED = """
reference = [t.tolist() for t in model.generate(ids, 12)]
model.forget_graphs()

def interrupt_decode():
    seen = []
    def on_token(tokens):
        seen.append(1)
        if len(seen) == 4:
            signal.raise_signal(signal.SIGINT)
    try:
        model.generate(ids, 12, on_token=on_token)
    except KeyboardInterrupt:
        return True
    return False

def interrupt_prefill():
    norm = type(model).final_norm
    def final_norm(self, *args, **kwargs):      # the prefill's last kernels, before its first pick
        type(model).final_norm = norm
        raise KeyboardInterrupt
    type(model).final_norm = final_norm
    try:
        model.generate(ids, 12)
    except KeyboardInterrupt:
        return True
    finally:
        type(model).final_norm = norm
    return False

for interrupt in (interrupt_decode, interrupt_prefill, interrupt_decode):
    assert interrupt(), interrupt.__name__
    again = [t.tolist() for t in model.generate(ids, 12)]
    assert again == reference, (interrupt.__name__, again, reference)
print("usable after every interrupt")
"""


def run_script(tmp_path, name: str, body: str, model: Path) -> subprocess.CompletedProcess:
    script = tmp_path / f"{name}.py"
    script.write_text(PROLOGUE.format(model=str(model)) + textwrap.dedent(body) + "\n")
    env = dict(os.environ, MODEL=str(model), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)


def assert_clean(p: subprocess.CompletedProcess, status: int) -> None:
    assert "Fatal Python error" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == status, (p.returncode, p.stderr[-3000:])


@pytest.mark.gpu
@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_every_ending_exits_with_its_status(ending, tmp_path):
    body, status = ENDINGS[ending]
    assert_clean(run_script(tmp_path, ending, body, MODELS["gpt2"]), status)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(MODELS))
def test_ctrl_c_in_prefill_and_decode_leaves_the_model_usable(family, tmp_path):
    p = run_script(tmp_path, "interrupted", INTERRUPTED, MODELS[family])
    assert_clean(p, 0)
    assert "usable after every interrupt" in p.stdout

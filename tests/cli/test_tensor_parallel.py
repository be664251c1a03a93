"""`tilekit generate --tp` / torchrun ranks and `tilekit tune --tp` on the CPU: each misuse is one `tilekit: ...`
line naming the argument or variable, exit 2, before any model loads or any rank starts."""

from pathlib import Path

import pytest

from tests.cli.test_cli import misuse

TINY = Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny-llama"
GENERATE = ["generate", "--model", str(TINY), "--prompt", "hi"]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def torchrun(monkeypatch, rank, world):
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 1)):
        monkeypatch.setenv(name, str(value))


def test_tp_needs_the_gpu(capsys):
    message = misuse(GENERATE + ["--tp", "2", "--device", "cpu"], capsys)
    assert message == "tilekit: tensor parallelism (--tp or WORLD_SIZE) needs --device cuda"


def test_tp_must_agree_with_world_size(monkeypatch, capsys):
    torchrun(monkeypatch, 0, 2)
    assert "--tp 4 but WORLD_SIZE=2" in misuse(GENERATE + ["--tp", "4"], capsys)
    assert "needs --device cuda" in misuse(GENERATE + ["--device", "cpu"], capsys)


@pytest.mark.parametrize("rank, world, message", [(2, 2, "RANK=2 is not below WORLD_SIZE=2"),
                                                  (0, "x", "WORLD_SIZE='x' is not an integer")])
def test_bad_ranks_are_named(monkeypatch, capsys, rank, world, message):
    torchrun(monkeypatch, rank, world)
    assert message in misuse(GENERATE, capsys)


def test_missing_master_addr_is_named(monkeypatch, capsys):
    torchrun(monkeypatch, 0, 2)
    monkeypatch.delenv("MASTER_ADDR")
    assert "MASTER_ADDR unset" in misuse(GENERATE, capsys)


@pytest.mark.parametrize("argv, message", [
    (["tune", "--kernel", "linear", "--shape", "M=8,N=8,K=8", "--tp", "2"], "--tp goes with --model"),
    (["tune", "--model", "deepseek-v2-lite", "--tp", "3"],
     "n_head (16) is not divisible by the tensor-parallel size 3"),
    (["tune", "--model", "gpt2", "--tp", "8"], "n_head (12) is not divisible by the tensor-parallel size 8"),
    (["tune", "--model", "llama-3.1-8b", "--tp", "3"], "n_head (32) is not divisible by the tensor-parallel size 3"),
])
def test_tune_tp_misuse(capsys, argv, message):
    assert message in misuse(argv, capsys)


def test_tp_without_gpus_says_so_before_starting_ranks(capsys):
    from tilekit.device import gpu_unavailable_reason
    if gpu_unavailable_reason() is None:
        pytest.skip("checks the message on a machine without a GPU")
    assert "tensor parallelism needs GPUs" in misuse(GENERATE + ["--tp", "2"], capsys)


def test_chat_refuses_to_run_as_a_rank(monkeypatch, capsys):
    torchrun(monkeypatch, 0, 2)
    assert "chat does not run tensor-parallel (WORLD_SIZE=2)" in misuse(["chat", "--model", str(TINY)], capsys)


def test_explain_tp_lists_a_ranks_deepseek_shapes(capsys):
    """`db explain --model deepseek-v2-lite --tp 2` (what `tune --tp 2` would tune) reports each rank's shard shapes."""
    from tests.cli.test_cli import run
    rc, out, err = run(["db", "explain", "--model", "deepseek-v2-lite", "--tp", "2", "--batch-sizes", "1",
                        "--seq-lens", "128", "--gpu", "NVIDIA H100 80GB HBM3", "--arch", "sm_90"], capsys)
    assert rc == 0, err
    keys = [line.split()[0] for line in out.splitlines()[1:]]
    assert "moe_gate_up/C=2048,E=66,I=704,M=128,dtype=bfloat16,slots=8" in keys
    assert not [k for k in keys if "I=1408" in k or "N=102400," in k] and any("N=51200," in k for k in keys)

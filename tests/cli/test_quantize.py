"""The `--quantize` option of tune, db explain and generate on CPU."""

from pathlib import Path

import pytest

from tests.cli.test_cli import misuse
from tilekit import cli

TINY_LLAMA = Path(__file__).resolve().parents[1] / "data" / "tiny-llama"


@pytest.mark.parametrize("argv, says", [
    (["tune", "--kernel", "linear", "--shape", "M=8,N=8,K=8", "--quantize", "int8"], "--quantize goes with --model"),
    (["tune", "--model", "gpt2", "--quantize", "int8"], "GPT models have no quantized linears"),
    (["tune", "--model", "llama-3.2-1b", "--quantize", "int4"], "invalid choice"),
    (["generate", "--model", str(TINY_LLAMA), "--prompt", "hi", "--quantize", "fp8", "--device", "cpu"],
     "--quantize needs --device cuda"),
    (["tune", "--model", "llama-3.1-8b", "--quantize-head"], "--quantize-head goes with --quantize"),
    (["db", "explain", "--model", "llama-3.2-1b", "--quantize", "int8", "--quantize-head"],
     "tied to the token embedding"),
])
def test_misuse_exits_2_with_one_line(argv, says, capsys):
    assert says in misuse(argv, capsys)


def test_db_explain_lists_the_quantized_workload(capsys):
    assert cli.main(["db", "explain", "--model", "llama-3.2-1b", "--quantize", "fp8", "--batch-sizes", "1",
                     "--seq-lens", "128", "--gpu", "NVIDIA H100 80GB HBM3"]) == 0
    out = capsys.readouterr().out
    assert "quant_linear/" in out and "quantize_fp8/" in out and "swiglu_linear/" not in out


def test_db_explain_lists_deepseek_v2_lites_quantized_workload(capsys):
    """tune --model deepseek-v2-lite --quantize fp8 tunes this workload: quant_linear at the attention's and the
    dense layer's shapes (the experts keep moe_gate_up / moe_down_combine)."""
    assert cli.main(["db", "explain", "--model", "deepseek-v2-lite", "--quantize", "fp8", "--batch-sizes", "1",
                     "--seq-lens", "128", "--gpu", "NVIDIA H100 80GB HBM3"]) == 0
    out = capsys.readouterr().out
    assert "quant_linear/" in out and "quantize_fp8/" in out and "moe_gate_up/" in out
    assert "swiglu_linear/" not in out


def test_db_explain_lists_a_quantized_heads_shapes(capsys):
    """--quantize-head: the untied LM head (Llama-3.1-8B's 128256 rows) is a quant_linear too, weight-only."""
    argv = ["db", "explain", "--model", "llama-3.1-8b", "--quantize", "int8", "--batch-sizes", "1", "--seq-lens", "128",
            "--gpu", "NVIDIA H100 80GB HBM3"]
    assert cli.main(argv) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if "N=128256" in line]
    assert heads and all(line.startswith("linear/") for line in heads)          # the bf16 head by default
    assert cli.main(argv + ["--quantize-head"]) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if "N=128256" in line]
    assert heads and all(line.startswith("quant_linear/") and "xq=none" in line for line in heads)

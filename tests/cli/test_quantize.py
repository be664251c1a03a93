"""The `--quantize` option of tune, db explain and generate on CPU."""

from pathlib import Path

import pytest

from tests._numpy_cupy import numpy_cupy  # noqa: F401  (a fixture)
from tests.cli.test_cli import misuse
from tests.models.test_quantization import LAYOUTS, write_quantized
from tilekit import cli
from tilekit.models import LlamaConfig

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


BLOCK_CONFIG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=256, intermediate_size=384, vocab_size=50,
                           max_position_embeddings=64, tie_word_embeddings=False, rope_scaling=None)


def explained(capsys, *argv) -> list[str]:
    assert cli.main(["db", "explain", "--batch-sizes", "1", "--seq-lens", "16", "--new-tokens", "4",
                     "--gpu", "NVIDIA H100 80GB HBM3", *argv]) == 0, capsys.readouterr().err
    return [line.split()[0] for line in capsys.readouterr().out.splitlines() if "/" in line.split(" ")[0]]


def test_a_quantized_checkpoints_workload_is_its_own(tmp_path, capsys):
    """tune / db explain --model <an FP8 checkpoint with 128 x 128 block scales>: the block-scaled quant_linear shapes
    the loaded model runs (not the bf16 linears, nor per-channel ones), its float LM head a linear; --quantize of
    another kind is refused naming both."""
    write_quantized(tmp_path, "fp8", "block", LAYOUTS["block fp8"][2], LAYOUTS["block fp8"][3], "weight_scale_inv",
                    config=BLOCK_CONFIG)
    keys = explained(capsys, "--model", str(tmp_path))
    quant = [k for k in keys if k.startswith("quant_linear/")]
    assert quant and all("scale=block" in k and "wq=fp8" in k for k in quant)
    assert not [k for k in keys if k.startswith(("swiglu_linear/", "residual_linear/"))]
    assert [k for k in keys if k.startswith("linear/")] and all("N=50," in k for k in keys if k.startswith("linear/"))
    assert keys == explained(capsys, "--model", str(tmp_path), "--quantize", "fp8")
    assert "holds fp8 weights" in misuse(["db", "explain", "--model", str(tmp_path), "--quantize", "int8",
                                          "--gpu", "NVIDIA H100 80GB HBM3"], capsys)


def test_a_checkpoints_lm_head_stored_as_codes_is_in_its_workload(numpy_cupy, tmp_path, capsys):
    """A compressed-tensors checkpoint (save_pretrained's) whose LM head holds int8 codes: its head is a weight-only
    quant_linear in the workload; a float checkpoint with --quantize int8 keeps a float head unless --quantize-head."""
    from tilekit.models import Llama
    from tilekit.models.llama.weights import random_state_dict, save_state_dict
    save_state_dict(tmp_path / "float", BLOCK_CONFIG, random_state_dict(BLOCK_CONFIG, 3))
    Llama.from_pretrained(tmp_path / "float", quantize="int8", quantize_head=True).save_pretrained(tmp_path / "int8")
    heads = [k for k in explained(capsys, "--model", str(tmp_path / "int8")) if "N=50," in k]
    assert heads and all(k.startswith("quant_linear/") and "wq=int8" in k and "xq=none" in k for k in heads)
    float_heads = [k for k in explained(capsys, "--model", str(tmp_path / "float"), "--quantize", "int8")
                   if "N=50," in k]
    assert float_heads and all(k.startswith("linear/") for k in float_heads)
    assert heads == [k for k in explained(capsys, "--model", str(tmp_path / "float"), "--quantize", "int8",
                                          "--quantize-head") if "N=50," in k]


def test_a_block_checkpoint_whose_shapes_cannot_take_its_scales_is_refused_in_one_line(tmp_path, capsys):
    config = BLOCK_CONFIG.replace(n_embd=160, head_dim=40)      # k and v projections of 80 rows
    write_quantized(tmp_path, "fp8", "block", LAYOUTS["block fp8"][2], LAYOUTS["block fp8"][3], "weight_scale_inv",
                    config=config)
    err = misuse(["tune", "--model", str(tmp_path)], capsys)
    assert "self_attn.k_proj.weight" in err and "multiples of 128 rows" in err

"""benchmarks.studies.deepseek without a GPU: the floor's bytes, the cache's values per token, the kernels it
compiles ahead, its arguments and table; then a GPU smoke test of every row at a tiny config."""

import json
import math

import numpy as np
import pytest

from benchmarks.studies import deepseek as bench
from tests.benchmarks.test_benchmarks import gpu
from tilekit.models.families import family_of_config, preset_config

LITE = preset_config("deepseek-v2-lite")
# the tiny fixture's shapes (tests/data/tiny-deepseek-v2) with a context for 128 + 128 tokens
TINY = LITE.replace(n_layer=3, n_head=4, n_embd=64, vocab_size=259, intermediate_size=96, moe_intermediate_size=32,
                    n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, kv_lora_rank=32,
                    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
                    rope_scaling=None, bos_token_id=256, eos_token_id=257)


def test_v2_lite_reads_about_4_9_gb_a_token():
    """The issue's count: 2.4B active parameters at batch 1, bf16 (every tensor by hand: attention, the dense
    layer, 2 shared and 6 routed experts in 26 MoE layers, the head, one embedding row)."""
    C, H, R, P, dn, dv, V, L = 2048, 16, 512, 64, 128, 128, 102400, 27
    attention = H * (dn + P) * C + (R + P) * C + R + H * (dn + dv) * R + C * H * dv + 2 * C
    expert = 3 * 1408 * C
    dense = 3 * 10944 * C
    moe = 64 * C + 8 * expert                          # the router, 6 routed + 2 shared experts
    active = L * attention + dense + 26 * moe + V * C + C + C      # head, final norm, one embedding row
    assert bench.active_weight_bytes(LITE, 1, 26 * 6) == 2 * active
    assert 4.85e9 < 2 * active < 4.95e9
    assert bench.moe_layers(LITE) == 26 and bench.expert_params(LITE) == expert
    # every routed expert read: every tensor but the embedding table's unread rows
    total = sum(math.prod(s) for s in family_of_config(LITE).weights.state_dict_shapes(LITE).values())
    assert total == 15_706_484_224
    assert bench.active_weight_bytes(LITE, 8, 26 * 64) == 2 * (total - V * C + 8 * C)
    tied = TINY.replace(tie_word_embeddings=True)      # the head reads the whole table
    tied_total = sum(math.prod(s) for s in family_of_config(tied).weights.state_dict_shapes(tied).values())
    assert bench.active_weight_bytes(tied, 2, 2 * 8, itemsize=4) == 4 * tied_total


def test_cache_values_come_from_the_allocations_not_their_views():
    class Latent:
        def __init__(self):
            self.entries = np.zeros((3, 2, 16, 48), np.float32)
            self.chunks = self.entries.reshape(3, 2, 16, 3, 16)      # a view: not counted again
            self.capacity = 16

    class Heads:
        def __init__(self):
            self.k, self.v = (np.zeros((3, 2, 4, 16, 32), np.float16) for _ in range(2))

    assert bench.cache_values_per_token_layer(Latent(), TINY, 2, 16) == 48
    assert bench.cache_values_per_token_layer(Heads(), TINY, 2, 16) == 2 * 4 * 32
    with pytest.raises(RuntimeError, match="no device arrays"):
        bench.cache_values_per_token_layer(type("Empty", (), {})(), TINY, 1, 1)
    assert bench.mha_values(LITE) == 16 * (128 + 64 + 128) == 5120          # vs 576 latent values: 8.9x
    assert bench.kv_bytes(LITE, 8, 576, 192.0) == 27 * 8 * 576 * 2 * 192


def test_the_kernels_compiled_ahead_are_every_call_once():
    model = family_of_config(TINY).model_class(TINY, dtype="bfloat16", meta=True)
    tasks = bench.workload_tasks(model, [1, 2], [64, 96], lambda op, p: op.default(p))
    names = {op.name for op, _, _ in tasks}
    assert {"mla_decode_attention", "moe_router", "moe_gate_up", "moe_down_combine", "attention", "next_token"} <= names
    keys = [(op.name, json.dumps(p, sort_keys=True)) for op, p, _ in tasks]
    assert len(keys) == len(set(keys))
    calls = model.kernel_problems(2, bench.PROMPT, bench.NEW_TOKENS) + model.kernel_problems(1, 64) \
        + model.kernel_problems(1, 96)
    assert {(op.name, json.dumps(p, sort_keys=True)) for op, p in calls} <= set(keys)
    assert all(config == op.default(p) for op, p, config in tasks)


def test_arguments(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("OUT", raising=False)
    a = bench.parse_args([])
    assert (a.model, a.batch, a.prefill, a.no_anchor, a.out) == ("deepseek-v2-lite", [1, 8, 32], [1024, 4096], False,
                                                                   None)
    monkeypatch.setenv("OUT", str(tmp_path))
    a = bench.parse_args(["--batch", "8", "--prefill", "0", "--no-anchor"])
    assert (a.out, a.batch, a.prefill) == (tmp_path, [8], [])
    assert (bench.parse_args(["--batch", "0", "--prefill", "512"]).batch, a.no_anchor) == ([], True)
    for argv, message in ((["--model", "gpt2"], "not a mixture-of-experts preset"), (["--model", "gpt5"], "not a preset"),
                          (["--batch", "-1"], "--batch and --prefill must be >= 0"),
                          (["--prefill", "-4"], "--batch and --prefill must be >= 0")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def _results():
    step = dict(name="compiled step", measure="step", ms=5.0, speedup=2.5, status="ok")
    gen = dict(name="HF x", measure="generate", ms=50.0, speedup=20.0, status="ok")
    decode = dict(batch=1, step_ms=2.0, floor_ms=1.6, pct_floor=80.0, generate_ms_per_token=2.5, anchors=[step, gen])
    failed = dict(decode, batch=8, anchors=[dict(step, ms=None, speedup=None, status="failed", note="logits off")])
    prefill = dict(seq=1024, forward_ms=40.0, tokens_per_s=25600.0,
                   anchors=[dict(name="HF compiled", measure="forward", ms=60.0, speedup=1.5, status="ok"),
                            dict(name="HF y", measure="forward", ms=80.0, speedup=2.0, status="ok")])
    cache = dict(values_per_token_layer=576.0, bytes_per_token_layer=1152.0, mha_values_per_token_layer=5120,
                 mha_bytes_per_token_layer=10240, ratio=5120 / 576)
    return dict(preset="deepseek-v2-lite", copy_gbs=3000.0, anchor="HF x", cache=cache, decode=[decode, failed],
                prefill=[prefill, dict(prefill, seq=4096, anchors=[])])


def test_table_and_json(monkeypatch, tmp_path, capsys):
    lines = bench.format_table(_results()).splitlines()
    assert lines[1].split() == ["decode", "B1", "step", "ms", "2.000", "1.600", "80%", "5.000", "2.50x", "ok",
                                "(compiled", "step)"]
    assert lines[2].split() == ["decode", "B1", "generate", "ms/token", "2.500", "50.000", "20.00x", "ok", "(HF", "x)"]
    assert lines[3].split()[-5:] == ["failed", "(compiled", "step:", "logits", "off)"]
    assert lines[4].split()[-2:] == ["no", "anchor"] and lines[4].split()[:4] == ["decode", "B8", "generate", "ms/token"]
    assert lines[5].split() == ["prefill", "B1", "T1024", "ms", "40.00", "60.000", "1.50x", "ok", "(HF", "compiled)"]
    assert lines[6].split() == ["prefill", "B1", "T1024", "ms", "40.00", "80.000", "2.00x", "ok", "(HF", "y)"]
    assert lines[7].split() == ["prefill", "B1", "T4096", "ms", "40.00", "-", "-", "no", "anchor"]
    assert "576 values (1152 B) per token and layer vs MHA 5120 (10240 B): 8.9x smaller" in lines[8]
    assert "copy bandwidth 3000 GB/s; HF model: HF x" in lines[9]
    seen = {}

    def run(config, preset, batches, prefill, anchor, log, saved):
        seen.update(preset=preset, batches=batches, prefill=prefill, anchor=anchor)
        saved(_results())           # after a row: written as it stands
        assert json.loads((tmp_path / "deepseek.json").read_text())["decode"][0]["batch"] == 1
        return _results(), 1
    monkeypatch.setattr(bench, "run", run)
    assert bench.main(["--batch", "1", "--batch", "8", "--no-anchor", "--out", str(tmp_path)]) == 1
    assert seen == dict(preset="deepseek-v2-lite", batches=[1, 8], prefill=[1024, 4096], anchor=False)
    saved = json.loads((tmp_path / "deepseek.json").read_text())
    assert saved["decode"][1]["anchors"][0]["status"] == "failed" and saved["seconds"] >= 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("deepseek-v2-lite, random weights, bf16")


@gpu
def test_gpu_every_row_at_a_tiny_config():
    """The floor's routed experts counted from the router, the HF model on tilekit's memory agreeing with it."""
    pytest.importorskip("transformers")
    results, failed = bench.run(TINY, "tiny", [1, 2], [64])
    assert failed == 0, results
    assert results["cache"]["values_per_token_layer"] == 32 + 16 and results["cache"]["ratio"] == 4 * (16 + 16 + 16) / 48
    for r in results["decode"]:
        assert [a["measure"] for a in r["anchors"]] == ["step", "generate"]
        for a in r["anchors"]:          # the compiled step and HF generate on tilekit's weights agree with it
            assert a["status"] == "ok" and a["speedup"] > 0 and a["logits_error"] < 5e-2, a
        assert 0 < r["pct_floor"] and r["step_ms"] > 0 and r["generate_ms_per_token"] > 0
        routed = r["routed_experts_per_layer"]
        assert routed == 3 if r["batch"] == 1 else 3 <= routed <= 6
    (p,) = results["prefill"]
    assert [a["name"] for a in p["anchors"]][0].startswith("HF compiled forward") and p["tokens_per_s"] > 0
    assert all(a["status"] == "ok" and a["speedup"] > 0 for a in p["anchors"]), p

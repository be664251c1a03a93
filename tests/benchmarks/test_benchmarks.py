"""CPU tests of the benchmark harness: arguments, arithmetic, checks, plans, row order, table, JSON / CSV,
markdown, charts, tuning statistics and the orchestration of each suite with the GPU stubbed; then GPU
smoke tests of every GPU path (skipped without a GPU and PyTorch)."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import cli
from benchmarks.harness import checks, markdown, plots, report, system, timing
from benchmarks.suites import kernels, model, overhead, tuning
from benchmarks.studies import tuning_stats
from benchmarks.harness.report import Row
from tilekit.models.gpt2 import weights as checkpoint
from tilekit.models.llama import weights as llama_checkpoint
from tilekit.models.families import family_of_config
from tilekit.models.gpt2.config import PRESETS, GPTConfig
from tilekit.models.llama.config import LlamaConfig, RopeScaling

ROOT = Path(__file__).resolve().parents[2]


# -- arguments ----------------------------------------------------------------------------------

def test_default_arguments():
    a = cli.parse_args([])
    assert (a.mode, a.out, a.only, a.no_plots) == ("quick", Path("bench-results"), None, False)


def test_mode_only_out_and_plots():
    a = cli.parse_args(["--full", "--only", "model", "--out", "/tmp/x", "--no-plots"])
    assert (a.mode, a.only, a.out, a.no_plots) == ("full", "model", Path("/tmp/x"), True)
    assert cli.parse_args(["--quick", "--only", "kernels"]).only == "kernels"
    assert cli.parse_args(["--only", "overhead"]).only == "overhead"


def test_model_filter():
    assert cli.parse_args([]).model is None
    assert cli.parse_args(["--only", "model", "--model", "gpt2-xl", "--model", "gpt2"]).model == ["gpt2-xl", "gpt2"]


def test_unknown_model_is_refused_naming_the_suites_models(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--model", "gpt3"])
    assert e.value.code == 2 and "--model gpt3: the quick model suite runs gpt2, gpt2-xl" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--quick", "--full"], ["--only", "layers"], ["--bogus"]])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2


def test_help_runs_without_gpu_libraries():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--quick" in out.stdout and "--only" in out.stdout
    probe = ("import sys, benchmarks.cli, benchmarks.__main__, benchmarks.harness.markdown, benchmarks.harness.plots, "
             "benchmarks.studies.tuning_stats; "
             "print(sorted(m for m in ('cupy', 'torch', 'transformers') if m in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
    assert imported.stdout.strip() == "[]", imported.stdout + imported.stderr


def test_main_without_gpu_says_why(monkeypatch, capsys):
    monkeypatch.setattr(cli, "gpu_problem", lambda: "no CUDA GPU available (test)")
    assert cli.main(["--quick"]) == 2
    assert "no CUDA GPU available (test)" in capsys.readouterr().err


# -- arithmetic ---------------------------------------------------------------------------------

def test_ratio_is_anchor_over_tilekit():
    assert report.ratio(2.0, 1.0) == 2.0
    assert report.ratio(1.0, 4.0) == 0.25
    assert report.ratio(None, 1.0) is None and report.ratio(1.0, 0.0) is None
    assert Row("kernels", "gelu", "g", "s", "F.gelu", tilekit_ms=0.5, anchor_ms=0.75).ratio == 1.5


def test_rates():
    assert report.rate(2e12, 1000.0, "TFLOP/s") == pytest.approx(2.0)        # 2 TFLOP in 1 s
    assert report.rate(3e9, 1.0, "GB/s") == pytest.approx(3000.0)            # 3 GB in 1 ms
    assert report.rate(8, 2.0, "tok/s") == pytest.approx(4000.0)
    assert report.rate(1.0, None, "GB/s") is None
    assert timing.gbs(3e9, 1.0) == pytest.approx(3000.0)
    assert timing.tflops(2 * 8192 ** 3, 1.0) == pytest.approx(1099.5, rel=1e-3)
    with pytest.raises(ValueError):
        report.rate(1.0, 1.0, "furlongs")


def test_param_counts_match_gpt2():
    assert report.param_count(GPTConfig.preset("gpt2")) == 124_439_808
    assert report.param_count(GPTConfig.preset("gpt2-xl")) == 1_557_611_200


def test_decode_floor():
    gpt2 = GPTConfig.preset("gpt2")
    # 124.4M bf16 parameters + K and V of 12 layers x 768 x 2 bytes at the mean context 128 + 128 / 2 = 192
    weights, kv = 124_439_808 * 2, 2 * 12 * 768 * 2 * 192
    assert report.decode_floor_ms(gpt2, 1, 128, 128, 3000.0) == pytest.approx((weights + kv) / 3e12 * 1e3)
    assert report.decode_floor_ms(gpt2, 1, 128, 128, 3000.0) == pytest.approx(0.08296 + 0.00236, rel=1e-3)
    b8 = report.decode_floor_ms(gpt2, 8, 128, 16, 1000.0, itemsize=4)
    assert b8 == pytest.approx((124_439_808 * 4 + 2 * 12 * 8 * 768 * 4 * 136) / 1e12 * 1e3)


def test_prefill_flops():
    c = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=10, block_size=16)
    B, T = 3, 5
    matmuls = 2 * B * T * (2 * (8 * 24 + 8 * 8 + 8 * 32 + 32 * 8) + 10 * 8)
    attention = 2 * (2 * B * T * T * 8)        # per layer: QK^T and PV, 2*B*T*T*C each, halved by causality
    assert report.prefill_flops(c, B, T) == pytest.approx(matmuls + attention)


def test_llama_param_count_and_decode_floor():
    """Llama-3.2-1B: every tensor (the tied LM head once); KV read per step from the 8 KV heads of 64 only."""
    llama = model.model_config("llama-3.2-1b")
    C, H, Hkv, D, F, V, L = 2048, 32, 8, 64, 8192, 128256, 16         # F: the MLP's intermediate size
    layer = C * H * D + 2 * C * Hkv * D + H * D * C + 3 * C * F + 2 * C
    assert report.param_count(llama) == V * C + L * layer + C == 1_235_814_400
    assert report.param_count(llama.replace(tie_word_embeddings=False)) == 1_235_814_400 + V * C
    weights, kv = 1_235_814_400 * 2, 2 * L * Hkv * D * 2 * 192        # mean context 128 + 128 / 2
    assert report.decode_floor_ms(llama, 1, 128, 128, 3000.0) == pytest.approx((weights + kv) / 3e12 * 1e3)
    b8 = report.decode_floor_ms(llama, 8, 128, 16, 1000.0, itemsize=4)
    assert b8 == pytest.approx((1_235_814_400 * 4 + 2 * L * 8 * Hkv * D * 4 * 136) / 1e12 * 1e3)
    assert report.kv_width(llama) == 512 and report.kv_width(GPTConfig.preset("gpt2")) == 768
    untied = llama.replace(tie_word_embeddings=False)       # the table's batch rows only: the head is the rest
    assert report.streamed_params(untied, 8) == 1_235_814_400 + 8 * C
    assert report.decode_floor_ms(untied, 8, 128, 16, 1000.0, itemsize=4) == pytest.approx(b8 + 8 * C * 4 / 1e9)


def test_streamed_bytes_of_a_built_model_skip_an_untied_table():
    """A model's own arrays: an untied table counts its batch rows, a tied one the head's rows (a rank's slice)."""
    class Built:
        def __init__(self, tied, head_rows):
            self.config = LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=8, head_dim=4, intermediate_size=16,
                                      vocab_size=100, max_position_embeddings=64, rope_scaling=None,
                                      tie_word_embeddings=tied)
            self.embed = np.zeros((100, 8), np.float32)
            self.head = self.embed[:head_rows] if tied else np.zeros((100, 8), np.float32)
            self.params = {"embed": self.embed, "w": np.zeros((8, 16), np.int8)}
            if not tied:
                self.params["head"] = self.head
    assert report.streamed_bytes(Built(False, 100), 3) == 128 + 3200 + 3 * 8 * 4
    assert report.streamed_bytes(Built(True, 100), 3) == 128 + 3200
    assert report.streamed_bytes(Built(True, 50), 3) == 128 + 1600


def test_llama_prefill_flops():
    """Grouped-query projections, SwiGLU and a head_dim that is not n_embd / n_head, against a hand count."""
    c = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, head_dim=6, intermediate_size=24, vocab_size=10,
                    max_position_embeddings=64, rope_scaling=None, tie_word_embeddings=False)
    B, T = 3, 5
    layer = 16 * 24 + 2 * (16 * 12) + 24 * 16 + 3 * (16 * 24)      # q, k + v, o, gate + up + down
    matmuls = 2 * B * T * (2 * layer + 10 * 16)
    attention = 2 * (2 * B * T * T * 24)       # per layer: QK^T and PV over H * D = 24, halved by causality
    assert report.layer_matmul_params(c) == layer == 2304
    assert report.prefill_flops(c, B, T) == pytest.approx(matmuls + attention)
    assert report.prefill_flops(c.replace(tie_word_embeddings=True), B, T) == report.prefill_flops(c, B, T)
    gpt2 = GPTConfig.preset("gpt2")
    assert report.layer_matmul_params(gpt2) == 12 * 768 * 768


def _t(ms: float) -> dict:
    return {"median_ms": ms, "p10_ms": 0.9 * ms, "p90_ms": 1.1 * ms, "reps": 3}


def test_fill_times_and_roofline():
    r = Row("kernels", "linear", "l", "s", "torch.matmul", unit="TFLOP/s", work=2e12, roofline=800.0)
    report.fill_times(r, {"median_ms": 4.0, "p10_ms": 3.9, "p90_ms": 4.2, "reps": 30},
                      {"median_ms": 5.0, "p10_ms": 4.8, "p90_ms": 5.5, "reps": 30})
    assert r.tilekit_perf == pytest.approx(500.0) and r.anchor_perf == pytest.approx(400.0)
    assert r.pct_roofline == pytest.approx(62.5) and r.anchor_pct_roofline == pytest.approx(50.0)
    assert r.ratio == pytest.approx(1.25) and (r.tilekit_p10_ms, r.anchor_p90_ms) == (3.9, 5.5)


def test_fill_times_against_a_floor():
    """Decode rows: % of floor = floor ms / measured ms on both sides; perf = batch tokens per second."""
    r = Row("model", "generate", "g", "s", "gpt-fast step", unit="tok/s", work=8.0, roofline=0.1,
            roofline_name="decode_floor_ms")
    report.fill_times(r, _t(0.5), _t(0.4))
    assert r.pct_roofline == pytest.approx(20.0) and r.anchor_pct_roofline == pytest.approx(25.0)
    assert r.tilekit_perf == pytest.approx(16000.0) and r.ratio == pytest.approx(0.8)
    r = Row("overhead", "linear", "linear cupy", "s", "-")
    report.fill_times(r, _t(0.01), None)
    assert r.tilekit_ms == 0.01 and r.anchor_ms is None and r.pct_roofline is None and r.ratio is None


def test_strongest_anchor_first():
    """Within each case the fastest measured anchor leads, unmeasured rows trail; cases keep their order."""
    rows = [Row("model", "generate", "g B1", "s", "HF sdpa", anchor_ms=5.0),
            Row("model", "generate", "g B1", "s", "HF static", status="skipped"),
            Row("model", "generate", "g B1", "s", "gpt-fast step", anchor_ms=0.6),
            Row("kernels", "attention", "a", "s", "sdpa flash", anchor_ms=0.05),
            Row("model", "generate", "g B8", "s", "HF sdpa", anchor_ms=6.0),
            Row("kernels", "attention", "a", "s", "sdpa cudnn", anchor_ms=0.04),
            Row("model", "generate", "g B1", "s", "HF eager", anchor_ms=5.0, status="failed")]
    got = [(r.label, r.anchor) for r in report.strongest_first(rows)]
    assert got == [("g B1", "gpt-fast step"), ("g B1", "HF sdpa"), ("g B1", "HF static"), ("g B1", "HF eager"),
                   ("a", "sdpa cudnn"), ("a", "sdpa flash"), ("g B8", "HF sdpa")]
    dicts = [r.as_dict() for r in rows]
    assert [d["anchor"] for d in report.strongest_first(dicts, lambda d, k: d.get(k))][:2] == ["gpt-fast step",
                                                                                             "HF sdpa"]


def test_summarize():
    s = timing.summarize([3.0, 1.0, 2.0, 4.0, 5.0])
    assert s["median_ms"] == 3.0 and s["reps"] == 5 and s["p10_ms"] < s["median_ms"] < s["p90_ms"]
    with pytest.raises(ValueError):
        timing.summarize([])


def test_per_token():
    t = model._per_token({"median_ms": 256.0, "p10_ms": 128.0, "p90_ms": 512.0, "reps": 3}, 128)
    assert t == {"median_ms": 2.0, "p10_ms": 1.0, "p90_ms": 4.0, "reps": 3}


def test_decode_verdict():
    """fp32 rows need every token of every sequence equal; every row needs the first-step logits within
    tolerance; the note gives the least and the median agreement over the batch."""
    assert model.decode_verdict([16], 16, 1e-6, 1e-4, exact=True) == ("ok", "greedy tokens agree for the first 16/16")
    status, note = model.decode_verdict([16, 15, 16], 16, 1e-6, 1e-4, exact=True)
    assert status == "failed" and "15/16" in note and "fp32" in note
    status, note = model.decode_verdict([40, 128, 0, 128, 7, 128, 128, 128], 128, 1e-2, 5e-2, exact=False)
    assert (status, note) == ("ok", "greedy tokens agree for the first 0/128 (least of 8 sequences; median 128)")
    assert model.decode_verdict([128], 128, 0.2, 5e-2, exact=False)[0] == "failed"
    assert model.decode_verdict([16], 16, float("inf"), 1e-4, exact=True)[0] == "failed"


def test_compile_budget(monkeypatch):
    import time
    monkeypatch.setattr(timing, "synchronize", lambda: None)
    b = timing.CompileBudget(0.0)
    assert b.skip_reason() is None                              # the first compile always runs
    out, seconds = b.first_call(lambda: time.sleep(0.002) or "out")
    assert out == "out" and seconds >= 0.002 and b.spent == seconds
    assert b.skip_reason().startswith("compile budget spent (0 s > 0 s)")
    roomy = timing.CompileBudget(1e9)
    roomy.first_call(lambda: None)
    assert roomy.skip_reason() is None

    def boom():
        raise RuntimeError("inductor exploded\nmore")
    with pytest.raises(RuntimeError):
        roomy.first_call(boom)
    assert roomy.skip_reason() == "torch.compile failed on an earlier shape (RuntimeError: inductor exploded)"


def test_host_time_synchronizes_outside_the_timed_calls(monkeypatch):
    events = []
    monkeypatch.setattr(timing, "synchronize", lambda: events.append("sync"))
    t = timing.host_time(lambda: events.append("call"), calls=250, sync_every=100)
    assert t["reps"] == 250 and t["median_ms"] >= 0
    assert events.count("call") == 251 and events.count("sync") == 4      # before calls 0, 100, 200, and after
    assert events[:3] == ["call", "sync", "call"]


# -- checks -------------------------------------------------------------------------------------

def test_bf16_bits_widen_exactly():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([0.0, -1.5, 3.140625, 1e-30, -65504.0, np.inf], np.float32).astype(ml_dtypes.bfloat16)
    got = checks.bf16_bits_to_f64(x.view(np.uint16), np)
    np.testing.assert_array_equal(got, x.astype(np.float64))


def test_rel_error_flat():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(1000)
    out = ref * (1 + 1e-3)
    assert checks.rel_error_flat(out, False, ref, False, np) == pytest.approx(1e-3)
    assert checks.rel_error_flat(out, False, ref, False, np, chunk=7) == pytest.approx(1e-3)
    bad = out.copy()
    bad[500] = np.nan
    assert checks.rel_error_flat(bad, False, ref, False, np, chunk=64) == math.inf
    with pytest.raises(ValueError):
        checks.rel_error_flat(out[:10], False, ref, False, np)


def test_rel_error_flat_mixes_bf16_and_float():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    ref = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    bits = ref.astype(ml_dtypes.bfloat16).view(np.uint16)
    err = checks.rel_error_flat(bits, True, ref, False, np, chunk=1000)
    assert 1e-4 < err < 2 ** -8            # bf16 rounding, nothing worse


def test_leading_agreement():
    assert checks.leading_agreement([1, 2, 3, 4], np.array([1, 2, 9, 4])) == 2
    assert checks.leading_agreement([5, 6], [5, 6]) == 2
    assert checks.leading_agreement([], [1]) == 0


# -- plans --------------------------------------------------------------------------------------

def test_kernel_rows_say_where_tilekit_configs_came_from(monkeypatch):
    """A suite row records whether tilekit ran a tuned config: the shipped entry of a GPT-2 shape, the
    heuristic default for the same matmul without its bias (a key no model tunes)."""
    from tilekit.autotune import store
    from tilekit.autotune.arrays import MetaArray
    from tilekit.autotune.op import recording
    from tilekit.device import DeviceInfo
    from tilekit.kernels import linear
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(ROOT / "tuning_db"))
    store.reset()
    h100 = DeviceInfo("NVIDIA H100 80GB HBM3", "sm_90", 132)
    x, w, b = MetaArray((8192, 768), "bfloat16"), MetaArray((768, 2304), "bfloat16"), MetaArray((2304,), "bfloat16")
    with recording() as calls:
        linear(x, w, b)
        linear(x, w)
    assert kernels.call_config_sources(calls[:1], h100) == "linear: shipped db, exact-gpu, exact bucket"
    assert kernels.call_config_sources(calls[1:], h100) == "linear: heuristic default"
    store.reset()


def test_untuned_study_measures_nearest_shapes_of_the_shipped_database(monkeypatch):
    """benchmarks.studies.untuned: Llama-3.1-8B MLP linears at M 1024..4096, W [N, K]; the shipped H100 and H200
    files lack these keys, so each resolves through the nearest-shape rule (the rows it times), never the default."""
    import tilekit.kernels  # noqa: F401  (declares the ops)
    from benchmarks.studies import space_ab, untuned
    from tilekit.autotune import store
    from tilekit.autotune.registry import registered_ops
    from tilekit.device import DeviceInfo
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(ROOT / "tuning_db"))
    store.reset()
    cases = untuned.cases()
    assert [c.params[2:] for c in cases] == [(M, K, N) for M in (1024, 2048, 4096)
                                             for K, N in ((4096, 14336), (14336, 4096))]
    assert kernels.describe(cases[1]) == ("lin llama-3.1-8b mlp.down_proj M1024", "M=1024 K=14336 N=4096, W [N, K]")
    assert kernels.work_of(cases[1])[1] == 2 * 1024 * 14336 * 4096
    for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        for case in cases:
            name, problem = space_ab.op_problem(case)
            assert problem["wt"] == "nk" and problem["bias"] == 0
            found = registered_ops()[name].resolve(problem, DeviceInfo(gpu, "sm_90", 132), "cached")
            assert found.source == "shipped" and found.match.rule == "nearest shape", found.describe()
    store.reset()


def test_space_ab_cases_and_axes():
    """space_ab tunes the suite's matmul and attention cases under the keys tilekit runs, groups the
    tuner's timings by an axis value, and refuses an --axis that names no op or no axis of it."""
    from benchmarks.studies import space_ab
    from tilekit.autotune.registry import registered_ops
    ops = registered_ops()
    head = space_ab.op_problem(kernels.Case("linear", ("gpt2", "lm_head", 8192, 768, 50257)))
    assert head == ("linear", dict(dtype="bfloat16", M=8192, N=50257, K=768, wt="nk", bias=0, act="none", res=0,
                                   tf32=0))
    assert space_ab.op_problem(kernels.Case("epilogue", ("gpt2", "mlp.c_fc", 8192, 768, 3072)))[1]["act"] == "gelu"
    assert space_ab.op_problem(kernels.Case("layer_norm", (8192, 768))) is None
    timings = {(("LONGEST_FIRST", 0), ("BM", 64)): 5.0, (("LONGEST_FIRST", 1), ("BM", 64)): 4.0,
               (("LONGEST_FIRST", 1), ("BM", 128)): 3.0}
    assert {v: us for v, (us, _) in space_ab.best_by_value(timings, "LONGEST_FIRST").items()} == {0: 5.0, 1: 3.0}
    assert space_ab.parse_axes(["attention:LONGEST_FIRST", "linear:PERSISTENT"], ops) == {
        "attention": "LONGEST_FIRST", "linear": "PERSISTENT"}
    for bad, message in (["linear", "must be linear:AXIS"], ["gelu:BLOCK", "must be linear:AXIS"],
                         ["linear:NOPE", "has no axis 'NOPE'"]):
        with pytest.raises(ValueError, match=message):
            space_ab.parse_axes([bad], ops)


def test_kernel_plans():
    quick, full = kernels.plan("quick"), kernels.plan("full")
    assert set(quick) <= set(full) and len(quick) < len(full)
    kinds = {c.kind for c in quick}
    assert kinds == {"linear", "epilogue", "attention", "layer_norm", "gelu", "decode_attention"}
    linear = [c.params for c in full if c.kind == "linear"]
    assert ("gpt2-xl", "mlp.c_proj", 8192, 6400, 1600) in linear and len(linear) == 4 * 3 * 5
    assert {(p[0], p[2]) for p in linear if p[1] == "lm_head"} == {(m, M) for m in kernels.FULL_WIDTH
                                                                   for M in (128, 1024, 8192)}
    assert [c.params[1] for c in quick if c.kind == "linear"].count("lm_head") == 2
    assert {c.params for c in full if c.kind == "attention"} == {(8, 12, 1024, 64), (1, 25, 1024, 64), (4, 16, 4096, 64),
                                                                 (4, 16, 2048, 128)}
    assert len([c for c in full if c.kind == "decode_attention"]) == 6
    big = [c for c in quick if c.kind == "layer_norm" and c.params[0] * c.params[1] * 2 >= 64 << 20]
    assert big, "a layer_norm input of at least 64 MB"
    with pytest.raises(ValueError):
        kernels.plan("medium")


def test_kernel_work():
    assert kernels.work_of(kernels.Case("linear", ("gpt2", "attn.c_attn", 8192, 768, 2304)))[1] == 2 * 8192 * 768 * 2304
    assert kernels.work_of(kernels.Case("attention", (8, 12, 1024, 64)))[1] == 2 * 8 * 12 * 1024 ** 2 * 64
    assert kernels.work_of(kernels.Case("decode_attention", (32, 12, 8192, 64)))[1] == 2 * 32 * 12 * 8192 * 64 * 2
    unit, nbytes, roof = kernels.work_of(kernels.Case("layer_norm", (8192, 768)))
    assert (unit, nbytes, roof) == ("GB/s", 2 * 8192 * 768 * 2 + 2 * 768 * 2, "copy_bandwidth_gbs")


def test_labels_fit_the_table():
    width = report.COLUMNS[0][1]
    labels = [kernels.describe(c)[0] for c in kernels.plan("full")]
    anchors = set()
    for p in model.plan("full"):
        labels += [model.prefill_label(p.preset, B, T) for (B, T), _ in p.prefill]
        labels += [model.decode_label(p.preset, B, p.new_tokens, p.dtype) for B, _ in p.decode]
        anchors |= {a for _, names in p.prefill + p.decode for a in names}
    assert len(set(labels)) == len(labels)
    assert max(map(len, labels)) <= width, max(labels, key=len)
    assert model.decode_label("gpt2", 1, 16, "float32") == "generate gpt2 fp32 B1 128+16"
    assert max(map(len, anchors | {"addmm+gelu+res", "torch.compile", "sdpa cudnn"})) <= report.COLUMNS[1][1]


def test_model_plans():
    """Quick keeps the compiled decode step at B1 and B8 and the compiled prefill at B1 T128 and B8 T1024
    for every model, HF generate at gpt2 B1 (static at llama B1), and the fp32 token check; full adds
    every anchor everywhere."""
    quick, full = model.plan("quick"), model.plan("full")
    assert [p.preset for p in quick] == ["gpt2", "gpt2-xl", "llama-3.2-1b", "gpt2"]
    bf16 = [p for p in quick if p.dtype == "bfloat16"]
    assert [p.preset for p in bf16] == ["gpt2", "gpt2-xl", "llama-3.2-1b"]
    for p in bf16[:2]:
        assert p.prefill == (((1, 128), ("HF compile", "HF sdpa")), ((8, 1024), ("HF compile", "HF sdpa")))
        assert [B for B, _ in p.decode] == [1, 8] and all(names[0] == "gpt-fast step" for _, names in p.decode)
    assert dict(bf16[0].decode)[1] == ("gpt-fast step", "HF static", "HF sdpa")
    fp32 = [p for p in quick if p.dtype == "float32"]
    assert fp32 == [model.fp32_check()] and fp32[0].new_tokens == 16 and fp32[0].preset == "gpt2"
    assert fp32[0].decode == ((1, ("HF sdpa", "gpt-fast eager")),) and not fp32[0].prefill
    llama = bf16[2]
    assert llama.prefill == (((1, 128), ("HF compile", "HF sdpa")), ((8, 1024), ("HF compile",)))
    assert llama.decode == ((1, ("gpt-fast step", "HF static")), (8, ("gpt-fast step",)))
    assert model.fp32_check((1, 8)) in full
    assert [p.preset for p in full] == ["gpt2", "gpt2-xl", "llama-3.2-1b", "gpt2"]
    for p in full:
        if p.dtype == "bfloat16":
            assert len(p.prefill) == 6 and [B for B, _ in p.decode] == [1, 8] and p.prefill_reps == 20
            if p.preset == "llama-3.2-1b":
                decode, prefill = {"gpt-fast step", "HF static"}, {"HF compile", "HF sdpa"}
            else:
                decode, prefill = {"gpt-fast step", "HF static", "HF sdpa", "HF eager"}, {"HF compile", "HF sdpa",
                                                                                           "HF eager"}
            assert all(set(names) == decode for _, names in p.decode)
            assert all(set(names) == prefill for _, names in p.prefill)
    assert all(128 + p.new_tokens <= model.model_config(p.preset).block_size for p in full)
    assert set(model.COMPILED) == set(model.COMPILE_BUDGET_S)
    with pytest.raises(ValueError):
        model.plan("slow")


def test_model_config_dispatches_on_the_preset():
    assert model.model_config("llama-3.2-1b") == LlamaConfig.preset("llama-3.2-1b")
    assert model.model_config("gpt2-xl") == GPTConfig.preset("gpt2-xl")
    assert family_of_config(model.model_config("llama-3.2-1b")).model_type == "llama"
    assert family_of_config(GPTConfig()).model_type == "gpt2"
    with pytest.raises(ValueError):
        model.model_config("gpt5")


def test_nudged_parameters():
    """Biases and LayerNorm weights of GPT-2 (HF names, as before Llama came), RMSNorm weights of Llama."""
    hf = [checkpoint.PREFIX + name for name in checkpoint.state_dict_shapes(TINY)]
    assert [n for n in hf if model.nudged(n)] == [n for n in hf if n.endswith(".bias") or ".ln_" in n or ".ln_f." in n]
    gpt = {name.removeprefix(checkpoint.PREFIX) for name in hf if model.nudged(name)}
    assert "ln_f.weight" in gpt and "h.1.ln_2.weight" in gpt and "wte.weight" not in gpt
    llama = {name for name in llama_checkpoint.state_dict_shapes(TINY_LLAMA) if model.nudged(name)}
    assert llama == {"model.norm.weight"} | {f"model.layers.{i}.{n}_layernorm.weight" for i in range(2)
                                             for n in ("input", "post_attention")}
    assert not model.nudged("lm_head.weight") and not model.nudged("model.embed_tokens.weight")


class _Tensor:
    """Enough of a torch tensor for tilekit_state: detach().float().cpu().numpy()."""

    def __init__(self, a):
        self.a = a

    def detach(self):
        return self

    def float(self):
        return _Tensor(self.a.astype(np.float32))

    def cpu(self):
        return self

    def numpy(self):
        return self.a


class _HF:
    def __init__(self, names):
        self.names = names

    def state_dict(self):
        return {name: _Tensor(np.full((2,), i, np.float64)) for i, name in enumerate(self.names)}


def test_tilekit_state_names():
    """GPT-2: "transformer." dropped, lm_head and mask buffers skipped; Llama: HF names kept, lm_head dropped
    only when tied; float32; a tensor tilekit expects and HF lacks is an error."""
    gpt_names = list(checkpoint.state_dict_shapes(TINY))
    hf = [checkpoint.PREFIX + n for n in gpt_names] + ["lm_head.weight", "transformer.h.0.attn.bias"]
    state = model.tilekit_state(_HF(hf), TINY)
    assert list(state) == gpt_names and all(a.dtype == np.float32 for a in state.values())
    for tied in (False, True):
        config = TINY_LLAMA.replace(tie_word_embeddings=tied)
        names = list(llama_checkpoint.state_dict_shapes(config))
        hf = names + ["lm_head.weight"] * tied + ["model.rotary_emb.inv_freq"]
        state = model.tilekit_state(_HF(hf), config)
        assert list(state) == names and ("lm_head.weight" in state) == (not tied)
    with pytest.raises(ValueError, match="lacks 1"):
        model.tilekit_state(_HF(names[1:] + ["lm_head.weight"]), config)


# -- output -------------------------------------------------------------------------------------

def fake_rows() -> list[Row]:
    ok = Row("kernels", "linear", "linear gpt2-xl attn.c_attn 1600x4800", "M=8192 K=1600 N=4800",
             "torch.matmul", unit="TFLOP/s", work=2 * 8192 * 1600 * 4800, roofline=790.0, error=3.2e-3,
             tolerance=2e-2, params={"kind": "linear"})
    report.fill_times(ok, {"median_ms": 0.21, "p10_ms": 0.2, "p90_ms": 0.23, "reps": 30},
                      {"median_ms": 0.19, "p10_ms": 0.18, "p90_ms": 0.2, "reps": 30})
    bw = Row("kernels", "layer_norm", "layer_norm 32768x1600", "M=32768 N=1600", "F.layer_norm",
             unit="GB/s", work=2 * 32768 * 1600 * 2, roofline=3000.0, error=1e-3)
    report.fill_times(bw, {"median_ms": 0.08, "p10_ms": 0.08, "p90_ms": 0.09, "reps": 30},
                      {"median_ms": 0.1, "p10_ms": 0.1, "p90_ms": 0.1, "reps": 30})
    failed = Row("kernels", "attention", "attention causal B8 H12 T1024", "B=8 H=12 T=1024 D=64",
                 "sdpa flash", error=float("inf"), tolerance=2e-2, status="failed",
                 note="relative error inf >= tolerance 0.02")
    err = Row("model", "prefill", "prefill gpt2-xl B8 T1024", "B=8 T=1024", "HF compile", status="error",
              note="RuntimeError: " + "very long message " * 20)
    skipped = Row("model", "prefill", "prefill gpt2 B1 T128", "B=1 T=128", "HF compile", status="skipped",
                  note="compile budget spent (95 s > 90 s)")
    dec = Row("model", "generate", "generate gpt2-xl B8 128+128", "B=8", "gpt-fast step", unit="tok/s",
              work=8.0, roofline=1.04, roofline_name="decode_floor_ms", error=1.2e-2,
              params={"greedy_agreement": 17, "new_tokens": 128, "greedy_agreement_per_sequence": [128, 17, 40]})
    report.fill_times(dec, _t(3.1), _t(25.0))
    return [ok, bw, failed, err, skipped, dec]


META = {"mode": "quick", "argv": ["--quick", "--out", "/root/out/x", "--no-plots"], "date": "2026-11-23T10:00:00+00:00",
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "driver": "580.159.04"},
        "versions": {"cuda_tile": "1.7.0", "tileiras": "13.4.92", "torch": "2.11.0", "transformers": "5.17.0"},
        "calibration": {"copy_bandwidth_gbs": 2950.4, "matmul_peak_tflops": 765.2}}


def test_table_fits_100_columns():
    text = report.format_table(fake_rows(), META)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert "NVIDIA H100" in lines[0]
    assert "FAILED" in text and "ERROR" in text and "SKIP" in text
    assert "0.90x" in text and "1.25x" in text and "8.06x" in text    # 0.19/0.21, 0.1/0.08, 25/3.1
    decode = next(line for line in lines if line.startswith("generate gpt2-xl B8"))
    assert decode.split()[-3:] == ["34%", "4%", "1.2e-02"]           # floor 1.04 ms over 3.1 and 25 ms
    assert "not measured:" in text and "compile budget spent" in text
    assert lines[-1].startswith("3/6 rows measured")
    assert text.index("kernels:") < text.index("model prefill") < text.index("model decode")


def test_section_titles_fit():
    assert max(len(title) for _, _, title in report.SECTIONS) <= report.WIDTH


def test_table_of_nothing():
    assert "0/0 rows measured" in report.format_table([], {})


def test_json_and_csv(tmp_path):
    rows = fake_rows()
    report.write_json(tmp_path / "results.json", META, rows)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["gpu"]["name"] == "NVIDIA H100 80GB HBM3"
    assert {"decode_floor_ms", "ratio", "kernel_ms", "host_us_per_call", "compile_s"} <= set(doc["definitions"])
    assert len(doc["rows"]) == len(rows)
    assert doc["rows"][0]["ratio"] == pytest.approx(0.19 / 0.21)
    assert doc["rows"][2]["error"] == "inf" and doc["rows"][2]["tilekit_ms"] is None
    assert doc["rows"][5]["anchor_pct_roofline"] == pytest.approx(100 * 1.04 / 25)
    report.write_csv(tmp_path / "results.csv", rows)
    with open(tmp_path / "results.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) and tuple(got[0]) == report.CSV_FIELDS
    assert float(got[1]["ratio"]) == pytest.approx(1.25)
    assert got[2]["status"] == "failed" and got[2]["tilekit_ms"] == ""
    assert json.loads(got[5]["params"])["greedy_agreement"] == 17


def test_exit_code():
    rows = fake_rows()
    assert report.exit_code(rows) == 1
    assert report.exit_code([r for r in rows if r.status in ("ok", "skipped")]) == 0


def test_write_outputs_without_plots(tmp_path):
    table = cli.write_outputs(tmp_path / "out", META, fake_rows(), plots=False, log=lambda m: None)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.csv", "results.json", "summary.txt"]
    assert (tmp_path / "out" / "summary.txt").read_text().strip() == table.strip()


def _two_anchors() -> list[Row]:
    """One kernel case whose slower anchor was measured first."""
    slow = Row("kernels", "attention", "attention causal B1 H25 T1024", "s", "sdpa flash", anchor_ms=0.03)
    fast = Row("kernels", "attention", "attention causal B1 H25 T1024", "s", "sdpa cudnn", anchor_ms=0.02)
    return [slow, fast]


def test_main_orchestration(tmp_path, monkeypatch, capsys):
    import contextlib
    calls = []
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(cli, "calibrate", lambda log: dict(META["calibration"]))
    monkeypatch.setattr(system, "environment", lambda mode, argv: {"mode": mode, "argv": argv, "gpu": dict(META["gpu"])})
    monkeypatch.setattr(system, "nvidia_smi", lambda bus=None: {})
    monkeypatch.setattr(timing, "shared_stream", contextlib.nullcontext)
    monkeypatch.setattr(kernels, "run", lambda mode, cal, log: calls.append(("kernels", mode)) or _two_anchors())
    monkeypatch.setattr(model, "run", lambda mode, cal, log, presets: calls.append(("model", mode)) or fake_rows()[5:])
    monkeypatch.setattr(tuning, "run", lambda mode, log: calls.append(("tuning", mode)) or [])
    monkeypatch.setattr(overhead, "run", lambda mode, log: calls.append(("overhead", mode)) or [])
    out = tmp_path / "res"
    assert cli.main(["--full", "--out", str(out), "--no-plots"]) == 0
    assert calls == [("kernels", "full"), ("model", "full"), ("tuning", "full"), ("overhead", "full")]
    stdout = capsys.readouterr().out
    assert stdout.rstrip().splitlines()[-1].startswith("3/3 rows measured")
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["mode"] == "full" and doc["meta"]["calibration"]["matmul_peak_tflops"] == 765.2
    assert "elapsed_s" in doc["meta"] and len(doc["rows"]) == 3
    assert [r["anchor"] for r in doc["rows"][:2]] == ["sdpa cudnn", "sdpa flash"]     # strongest first
    calls.clear()
    assert cli.main(["--only", "kernels", "--out", str(out), "--no-plots"]) == 0
    assert calls == [("kernels", "quick")]
    calls.clear()
    assert cli.main(["--only", "overhead", "--out", str(out), "--no-plots"]) == 0
    assert calls == [("overhead", "quick")]


def test_kernel_case_checks_before_timing_and_budgets_compiles(monkeypatch):
    """Outputs are checked before either side is timed; tilekit is timed once; a compiled anchor's first
    call is charged to the budget and skipped once it is spent; an unavailable anchor is skipped."""
    case = kernels.Case("epilogue", ("gpt2", "mlp.c_fc", 64, 32, 128))

    def tk():
        return "tk"

    def absent():
        raise kernels.Unavailable("SDPBackend.CUDNN_ATTENTION: not here")
    anchors = [("addmm+gelu+res", lambda: "eager"), ("torch.compile", lambda: "compiled"),
               ("wrong", lambda: "bad"), ("absent", absent)]
    monkeypatch.setattr(kernels, "build", lambda case, mode: kernels.Built(tk, anchors, compiled=("torch.compile",)))
    monkeypatch.setattr(checks, "rel_error", lambda out, ref: 0.5 if ref == "bad" else 1e-3)
    monkeypatch.setattr(timing, "synchronize", lambda: None)
    timed = []
    monkeypatch.setattr(timing, "measure_graph", lambda fn, **kw: timed.append(fn()) or (
        _t(0.1) if fn is tk else dict(_t(0.2), eager="timed eagerly, graph capture failed: X") if fn() == "eager"
        else _t(0.2)))
    calib = {"matmul_peak_tflops": 800.0}
    rows = kernels.run_case(case, calib, reps=3, budget=timing.CompileBudget(1e9), log=lambda m: None)
    assert [(r.anchor, r.status) for r in rows] == [("addmm+gelu+res", "ok"), ("torch.compile", "ok"),
                                                   ("wrong", "failed"), ("absent", "skipped")]
    assert timed == ["tk", "eager", "compiled"]
    assert rows[0].note == "anchor timed eagerly, graph capture failed: X" and rows[1].ratio == pytest.approx(2.0)
    assert rows[1].params["compile_mode"] == "default" and "first call (compile)" in rows[1].note
    assert rows[0].ratio == pytest.approx(2.0) and rows[0].pct_roofline is not None
    assert "not here" in rows[3].note and rows[2].tilekit_ms is None
    spent = timing.CompileBudget(0.0)
    spent.spent = 1.0
    rows = kernels.run_case(case, calib, reps=3, budget=spent, log=lambda m: None)
    assert rows[1].status == "skipped" and "compile budget spent" in rows[1].note


def test_config_sources_count_the_workload(monkeypatch):
    """The tuning suite counts config sources over workload.forward_problems / generate_problems."""
    from types import SimpleNamespace

    import tilekit.device
    from tilekit.engine import workload

    class Op:
        def resolve(self, problem, device, mode):
            assert (device, mode) == ("this GPU", "cached")
            return problem

    def found(source, rule):
        match = None if rule is None else SimpleNamespace(rule=rule, exact=rule == "exact")
        return SimpleNamespace(source=source, match=match)
    problems = [(Op(), found("shipped", "exact")), (Op(), found("shipped", "exact")),
                (Op(), found("shipped", "nearest bucket")), (Op(), found("shipped", "nearest shape")),
                (Op(), found("default", None))]
    calls = []
    monkeypatch.setattr(workload, "forward_problems", lambda *a: calls.append(("forward",) + a) or problems,
                        raising=False)
    monkeypatch.setattr(workload, "generate_problems", lambda *a: calls.append(("generate",) + a) or problems[:1],
                        raising=False)
    monkeypatch.setattr(tilekit.device, "device_info", lambda: "this GPU")
    config = GPTConfig.preset("gpt2")
    assert tuning.config_sources(config, 8, 1024, prefill=True) == (
        "2 shipped, 1 shipped (nearest bucket), 1 shipped (nearest shape), 1 default")
    assert tuning.config_sources(config, 1, 128, prefill=False) == "1 shipped"
    assert calls == [("forward", config, "bfloat16", 8, 1024), ("generate", config, "bfloat16", 1, 128, 128)]


def test_autotune_mode_is_set_and_restored(monkeypatch):
    from tilekit.autotune.op import autotune_mode
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "auto")
    with tuning.autotune_mode("off"):
        assert autotune_mode() == "off"
    assert autotune_mode() == "auto"
    monkeypatch.delenv("TILEKIT_AUTOTUNE")
    with pytest.raises(KeyError), tuning.autotune_mode("off"):
        raise KeyError("an error inside the block still restores the mode")
    assert "TILEKIT_AUTOTUNE" not in __import__("os").environ


def test_both_modes_drop_graphs_before_measuring():
    from tilekit.autotune.op import autotune_mode
    events = []

    class FakeModel:
        def forget_graphs(self):
            events.append("forget")

    got = tuning.in_both_modes(FakeModel(), lambda mode: events.append((mode, autotune_mode())) or mode * 2)
    assert got == {"off": "offoff", "cached": "cachedcached"}
    assert events == ["forget", ("off", "off"), "forget", ("cached", "cached")]


def test_tuning_plans_cover_the_presets():
    quick, full = tuning.plan("quick"), tuning.plan("full")
    assert {p for p, _, _ in quick} <= {p for p, _, _ in full} == set(PRESETS)
    with pytest.raises(ValueError, match="mode"):
        tuning.plan("slow")


def test_smi_parsing():
    text = ("name, clocks.current.sm [MHz], clocks.current.memory [MHz], clocks.max.sm [MHz], driver_version\n"
            "NVIDIA H200, 1980 MHz, 3201 MHz, 1980 MHz, 580.159.03\n")
    d = system.parse_smi_csv(text)
    assert d == {"name": "NVIDIA H200", "clocks.current.sm": "1980 MHz", "clocks.current.memory": "3201 MHz",
                 "clocks.max.sm": "1980 MHz", "driver_version": "580.159.03"}
    assert system.parse_smi_csv("") == {}


# -- overhead suite -----------------------------------------------------------------------------

def test_overhead_suite_orchestration(monkeypatch):
    """Each op x kind x out= row is checked against the torch op, then host-timed; torch rows carry the
    torch op's time; a first-call row per op; the ct.launch floor last."""
    def reference():
        return "ref"

    def floor():
        return None

    def linear_call(kind, with_out):
        return lambda: ("out", kind, with_out)

    def attention_call(kind, with_out):
        if kind == "cupy":
            raise RuntimeError("no CuPy here")
        return lambda: ("out", kind, with_out)
    monkeypatch.setattr(overhead, "cases", lambda: [
        overhead.Case("linear", "x 16x64", "torch.addmm", reference, linear_call),
        overhead.Case("attention", "B1 H1 T64", "F.sdpa", reference, attention_call)])
    monkeypatch.setattr(overhead, "launch_floor", lambda: floor)
    monkeypatch.setattr(overhead, "first_call_time", lambda fn: _t(0.2))
    monkeypatch.setattr(checks, "rel_error", lambda out, ref: 0.5 if out == ("out", "cupy", True) else 1e-3)
    monkeypatch.setattr(timing, "host_time", lambda fn, calls: _t(0.005 if fn is reference else
                                                                 0.004 if fn is floor else 0.05))
    rows = overhead.run(log=lambda m: None, calls=10)
    assert [r.label for r in rows] == [
        "linear torch", "linear torch out=", "linear cupy", "linear cupy out=", "linear first call",
        "attention torch", "attention torch out=", "attention cupy", "attention cupy out=", "attention first call",
        "ct.launch floor"]
    by = {r.label: r for r in rows}
    assert by["linear torch"].anchor == "torch.addmm" and by["linear torch"].anchor_ms == 0.005
    assert by["linear torch"].tilekit_ms == 0.05 and by["linear torch"].ratio == pytest.approx(0.1)
    assert by["linear cupy"].anchor == "-" and by["linear cupy"].anchor_ms is None and by["linear cupy"].status == "ok"
    assert by["linear cupy out="].status == "failed" and by["linear cupy out="].tilekit_ms is None
    assert by["attention cupy"].status == "error" and "no CuPy here" in by["attention cupy"].note
    assert by["linear first call"].tilekit_ms == 0.2 and "store.reset()" in by["linear first call"].note
    assert by["ct.launch floor"].tilekit_ms == 0.004 and by["ct.launch floor"].status == "ok"
    assert {r.suite for r in rows} == {"overhead"} and by["linear torch out="].params["out"] is True


def test_first_call_time_resets_plans_before_each_call(monkeypatch):
    events = []
    monkeypatch.setattr(timing, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(overhead, "reset_plans", lambda: events.append("reset"))
    t = overhead.first_call_time(lambda: events.append("call"), reps=3)
    assert t["reps"] == 3 and events == ["sync", "reset", "call"] * 3 + ["sync"]


def test_overhead_standalone_imports_the_given_checkout(tmp_path, monkeypatch, capsys):
    """`python -m benchmarks.suites.overhead --tilekit DIR` puts DIR first on sys.path and writes overhead.json."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(system, "gpu_identity", lambda: dict(META["gpu"]))
    monkeypatch.setattr(system, "versions", lambda: dict(META["versions"]))
    monkeypatch.setattr(overhead, "tilekit_source", lambda: {"path": sys.path[0], "commit": "abc123"})
    seen = {}

    def fake_run(log, calls):
        seen["calls"] = calls
        r = Row("overhead", "linear", "linear torch", "x", "torch.addmm")
        return [report.fill_times(r, _t(0.04), _t(0.005))]
    monkeypatch.setattr(overhead, "run", fake_run)
    old = tmp_path / "old-checkout"
    assert overhead.main(["--tilekit", str(old), "--out", str(tmp_path / "o"), "--calls", "7"]) == 0
    assert sys.path[0] == str(old.resolve()) and seen["calls"] == 7
    doc = json.loads((tmp_path / "o" / "overhead.json").read_text())
    assert doc["meta"]["mode"] == "overhead" and doc["meta"]["tilekit"] == {"path": str(old.resolve()),
                                                                          "commit": "abc123"}
    assert doc["rows"][0]["tilekit_ms"] == 0.04
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("1/1 rows measured")
    text = markdown.render(doc)
    assert "`python -m benchmarks.suites.overhead --tilekit" in text and "at abc123" in text
    assert "| linear torch | 40.0 | 36.0 / 44.0 | torch.addmm | 5.0 |" in text


def test_tilekit_source_names_this_checkout():
    src = overhead.tilekit_source()
    assert Path(src["path"]) == ROOT / "tilekit"
    assert src["commit"] is None or len(src["commit"]) == 40


# -- markdown, plots, tuning statistics ---------------------------------------------------------

def test_markdown_renders_new_fields_strongest_first(tmp_path):
    rows = fake_rows() + _two_anchors() + [report.fill_times(
        Row("overhead", "ct.launch", "ct.launch floor", "one-array kernel", "-"), _t(0.0045), None)]
    report.write_json(tmp_path / "r.json", META, rows)
    text = markdown.render(json.loads((tmp_path / "r.json").read_text()))
    lines = text.splitlines()
    assert lines[0].startswith("NVIDIA H100 80GB HBM3 (132 SMs, driver 580.159.04), 2026-11-23, "
                               "`python -m benchmarks --quick --no-plots`; cuda-tile 1.7.0, tileiras 13.4.92")
    assert "copy 2950 GB/s" in lines[0] and "/root/out" not in lines[0]
    assert "| case | anchor | tilekit ms | anchor ms | anchor/tilekit | tilekit perf | tilekit % of floor | " \
           "anchor % of floor | check |" in lines
    assert ("| generate gpt2-xl B8 128+128 | gpt-fast step | 3.100 | 25.000 | 8.06x | 2580.6 tok/s | 34% | 4% | "
            "err 1.2e-02, 17/128 tokens agree (least of 3; median 40) |") in lines
    assert lines.index("**kernels**") < lines.index("**model**") < lines.index("**overhead**")
    cudnn, flash = (lines.index(next(line for line in lines if line.startswith(f"| attention causal B1 H25 T1024 | {a} |")))
                    for a in ("sdpa cudnn", "sdpa flash"))
    assert cudnn < flash
    assert "| ct.launch floor | 4.5 | 4.0 / 5.0 | - | - |" in lines
    assert "| prefill gpt2 B1 T128 | HF compile | skipped: compile budget spent (95 s > 90 s) |" in text


def test_markdown_table_from_the_committed_run():
    """The committed overhead run renders row for row (the README's host-overhead figures come from it)."""
    results = json.loads((ROOT / "docs/results/overhead-h100.json").read_text())
    text = markdown.render(results)
    assert results["meta"]["gpu"]["name"] in text
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| call")]
    assert len(table) == len(results["rows"])
    for r in results["rows"]:
        assert any(line.startswith(f"| {r['label']} |") for line in table), r["label"]


def test_markdown_suite_filter_and_tuning_table(tmp_path):
    """--suite keeps one suite's rows; tuning rows get their own columns and name their config sources."""
    tuned = Row("tuning", "prefill", "prefill gpt2 B1 T128", "B=1 T=128", tuning.UNTUNED, unit="TFLOP/s",
                note=markdown.SOURCES_PREFIX + "11 shipped")
    report.fill_times(tuned, _t(0.45), _t(0.75))
    report.write_json(tmp_path / "r.json", META, fake_rows() + [tuned])
    results = json.loads((tmp_path / "r.json").read_text())
    kernels_only = markdown.render(results, "kernels")
    n_kernel_rows = sum(r["suite"] == "kernels" for r in results["rows"])
    assert sum(line.startswith("| ") for line in kernels_only.splitlines()) == n_kernel_rows + 1
    assert "prefill" not in kernels_only and "**kernels**" not in kernels_only
    text = markdown.render(results, "tuning")
    assert "TILEKIT_AUTOTUNE=off" in text and "11 shipped" in text
    assert "| prefill gpt2 B1 T128 | 0.750 | 0.450 | 1.67x |" in text
    with pytest.raises(SystemExit):
        markdown.main([str(tmp_path / "r.json"), "--suite", "bogus"])


def test_plots_are_drawn_from_the_json(tmp_path, monkeypatch, capsys):
    """The charts get the JSON's rows (one suite's, when asked), strongest anchor first; the CLI names
    the files after the JSON and the suite."""
    drawn = {}

    def chart(kind):
        def draw(rows, *rest):
            path = rest[-1]
            drawn[path.name] = [(r["label"], r["anchor"]) for r in rows]
            return path
        return draw
    monkeypatch.setattr(plots, "ratio_chart", chart("ratio"))
    monkeypatch.setattr(plots, "roofline_chart", chart("roofline"))
    report.write_json(tmp_path / "h100.json", META, fake_rows() + _two_anchors())
    made = plots.write_all(tmp_path / "h100.json", tmp_path)
    assert [p.name for p in made] == ["ratio.png", "roofline.png"]
    assert drawn["ratio.png"][-2:] == [("attention causal B1 H25 T1024", "sdpa cudnn"),
                                       ("attention causal B1 H25 T1024", "sdpa flash")]
    monkeypatch.setattr(plots, "available", lambda: True)
    assert plots.main([str(tmp_path / "h100.json"), "--suite", "model"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "h100-model-ratio.png"),
                                               str(tmp_path / "h100-model-roofline.png")]
    assert {label.split()[0] for label, _ in drawn["h100-model-ratio.png"]} == {"prefill", "generate"}


def test_charts(tmp_path):
    pytest.importorskip("matplotlib")
    report.write_json(tmp_path / "results.json", META, fake_rows())
    made = plots.write_all(tmp_path / "results.json", tmp_path)
    assert [p.name for p in made] == ["ratio.png", "roofline.png"]
    assert all(p.stat().st_size > 1000 for p in made)


def test_tuning_stats_distribution(tmp_path):
    entries = {"linear/M=1": {"time_us": 10.0, "default_time_us": 20.0, "config": {"a": 1}, "default_config": {"a": 2}},
               "linear/M=8": {"time_us": 10.0, "default_time_us": 10.0, "config": {"a": 1}, "default_config": {"a": 1}},
               "linear/M=64": {"time_us": 10.0, "default_time_us": 15.0, "config": {"a": 3}, "default_config": {"a": 1}},
               "gelu/n=4": {"time_us": 5.0, "default_time_us": None, "config": {"b": 1}, "default_config": {"b": 2}}}
    path = tmp_path / "sm_90" / "NVIDIA_X.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"schema": 1, "device": {}, "entries": entries}))
    assert tuning_stats.speedup(entries["linear/M=1"]) == 2.0 and tuning_stats.speedup(entries["gelu/n=4"]) is None
    d = tuning_stats.distribution([1.0, 1.5, 2.0])
    assert d == {"worst": 1.0, "q1": 1.25, "median": 1.5, "q3": 1.75, "best": 2.0, "count": 3}
    lines = tuning_stats.table([path]).splitlines()
    assert lines[0].startswith("| tuning file | op | entries | default timed | config changed | worst |")
    assert lines[2] == "| sm_90/NVIDIA_X.json | all ops | 4 | 3 | 3 | 1.00x | 1.25x | 1.50x | 1.75x | 2.00x |"
    assert lines[3] == "| sm_90/NVIDIA_X.json | gelu | 1 | 0 | 1 | - | - | - | - | - |"
    assert lines[4] == "| sm_90/NVIDIA_X.json | linear | 3 | 3 | 2 | 1.00x | 1.25x | 1.50x | 1.75x | 2.00x |"


def test_tuning_stats_of_the_shipped_files(capsys):
    assert tuning_stats.main([]) == 0
    out = capsys.readouterr().out
    for path in sorted((ROOT / "tuning_db").glob("*/*.json")):
        n = len(json.loads(path.read_text())["entries"])
        assert f"| {path.parent.name}/{path.name} | all ops | {n} |" in out
    assert "NVIDIA_H100_80GB_HBM3.json" in out


# -- GPU smoke tests: small shapes through every GPU path; skipped without a GPU and PyTorch ------

def _gpu_reason():
    import importlib.util
    from tilekit.device import gpu_unavailable_reason
    reason = gpu_unavailable_reason()
    if reason:
        return reason
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed"
    import torch
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


GPU_REASON = _gpu_reason()


def gpu(test):
    """A GPU smoke test: marked `gpu`, and skipped without a GPU and PyTorch."""
    return pytest.mark.gpu(pytest.mark.skipif(GPU_REASON is not None, reason=f"GPU smoke test: {GPU_REASON}")(test))


CALIB = {"copy_bandwidth_gbs": 3000.0, "matmul_peak_tflops": 800.0}
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=1000, block_size=512)
TINY_LLAMA = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=256, intermediate_size=512, vocab_size=1000,
                         max_position_embeddings=512, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 256),
                         tie_word_embeddings=False)


@gpu
def test_gpu_timer_streams_and_calibration():
    import cupy
    import torch
    with timing.shared_stream() as s:
        assert s.ptr == torch.cuda.current_stream().cuda_stream
        a = torch.randn(1024, 1024, device="cuda")
        t = timing.measure(lambda: a @ a, flush_l2=True, warmup=1, reps=5)
        assert t["reps"] == 5 and 0 < t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
        g = timing.measure_graph(lambda: a @ a, flush_l2=True, warmup=1, reps=5)
        assert g["reps"] == 5 and 0 < g["median_ms"] < 10 * t["median_ms"]
        c = cupy.ones((512, 512), dtype=cupy.float32)
        graph, out = timing.capture(lambda: c * 3)                  # CuPy follows torch onto the capture stream
        out.fill(0)
        graph.replay()
        timing.synchronize()
        assert float(out[0, 0]) == 3.0
        eager = timing.measure_graph(lambda: c @ c, flush_l2=False, warmup=1, reps=3)   # CuPy refuses cuBLAS
        assert eager["reps"] == 3 and "graph capture failed" in eager["eager"]
        cal = cli.calibrate(lambda m: None)
        assert 300 < cal["copy_bandwidth_gbs"] < 50000 and 20 < cal["matmul_peak_tflops"] < 10000
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with timing.shared_stream() as s:          # follows torch onto a side stream
            assert s.ptr == side.cuda_stream
            assert timing.measure(lambda: a @ a, flush_l2=False, warmup=0, reps=2)["reps"] == 2
        with pytest.raises(RuntimeError, match="current stream"):
            timing.measure(lambda: None, flush_l2=False, reps=1)   # CuPy still on its own stream


@gpu
def test_gpu_rel_error_across_kinds():
    import cupy
    import torch
    x = torch.randn(4096, device="cuda").to(torch.bfloat16)
    assert checks.rel_error(x, x) == 0.0
    assert checks.rel_error(x, cupy.from_dlpack(x.float())) == 0.0
    assert checks.rel_error(x.float() * 1.01, x.float()) == pytest.approx(0.01, rel=1e-4)
    import ml_dtypes
    c = cupy.asarray(np.random.default_rng(0).standard_normal((64, 64)).astype(ml_dtypes.bfloat16))
    widened = checks.bf16_bits_to_f64(c.view(cupy.uint16), cupy)
    assert checks.rel_error(c, widened) == 0.0 and checks.rel_error(c.T, widened.T) == 0.0


SMALL_CASES = [kernels.Case("linear", ("tiny", "x", 256, 128, 384)),
               kernels.Case("epilogue", ("tiny", "x", 256, 128, 512)),
               kernels.Case("attention", (1, 2, 128, 64)),
               kernels.Case("layer_norm", (64, 256)),
               kernels.Case("gelu", (64, 256)),
               kernels.Case("decode_attention", (2, 2, 256, 64))]


@gpu
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: c.kind)
def test_gpu_kernel_cases(case):
    with timing.shared_stream():
        rows = kernels.run_case(case, CALIB, reps=3, warmup=1, log=print)
    assert rows
    for r in rows:
        allowed = ("ok", "skipped") if r.anchor in ("cupy.matmul", "sdpa cudnn") else ("ok",)
        assert r.status in allowed, (r.anchor, r.status, r.note)
        if r.status == "ok":
            assert r.tilekit_ms > 0 and r.anchor_ms > 0 and r.error < r.tolerance and r.tilekit_perf > 0


@gpu
def test_gpu_model_tiny():
    """Every prefill and decode anchor on a 2-layer model: checked, timed, compiled ones noted."""
    pytest.importorskip("transformers")
    prefill, decode = ("HF compile", "HF sdpa", "HF eager"), ("gpt-fast step", "HF static", "HF sdpa", "HF eager")
    p = model.ModelPlan("tiny", prefill=(((2, 64), prefill),), decode=((2, decode),), new_tokens=32, prefill_reps=2,
                        config=TINY)
    with timing.shared_stream():
        rows = model.run_preset(p, CALIB, log=print)
    assert [(r.name, r.anchor) for r in rows] == [("prefill", a) for a in prefill] + [("generate", a) for a in decode]
    for r in rows:
        assert r.status == "ok", (r.label, r.anchor, r.status, r.note)
        assert r.tilekit_ms > 0 and r.anchor_ms > 0 and r.pct_roofline is not None
        assert r.error < checks.MODEL_TOLERANCE and (r.anchor in model.COMPILED) == ("compile_s" in r.params)
    assert all(len(r.params["greedy_agreement_per_sequence"]) == 2 for r in rows if r.name == "generate")


@gpu
@pytest.mark.parametrize("preset, config",
                         [("tiny", TINY), ("tiny-llama", TINY_LLAMA.replace(tie_word_embeddings=True))])
def test_gpu_model_fp32_tokens_match(preset, config):
    """fp32 greedy tokens of tilekit, HF and the gpt-fast module (GPT-2; Llama with a tied head) are equal, or the
    rows fail."""
    pytest.importorskip("transformers")
    p = model.ModelPlan(preset, decode=((1, ("HF sdpa", "gpt-fast eager")), (4, ("HF sdpa", "gpt-fast eager"))),
                        dtype="float32", new_tokens=16, config=config)
    with timing.shared_stream():
        rows = model.run_preset(p, CALIB, log=print)
    for r in rows:
        assert r.status == "ok", (r.anchor, r.status, r.note)
        assert r.params["greedy_agreement"] == 16 and r.error < checks.TOLERANCE["float32"]


@gpu
def test_gpu_model_tiny_llama():
    """Llama's anchors on a 2-layer grouped-query model with an untied head: checked, timed."""
    pytest.importorskip("transformers")
    prefill, decode = ("HF compile", "HF sdpa"), ("gpt-fast step", "HF static")
    p = model.ModelPlan("tiny-llama", prefill=(((2, 64), prefill),), decode=((2, decode),), new_tokens=32,
                        prefill_reps=2, config=TINY_LLAMA)
    with timing.shared_stream():
        rows = model.run_preset(p, CALIB, log=print)
    assert [(r.name, r.anchor) for r in rows] == [("prefill", a) for a in prefill] + [("generate", a) for a in decode]
    for r in rows:
        assert r.status == "ok", (r.label, r.anchor, r.status, r.note)
        assert r.tilekit_ms > 0 and r.anchor_ms > 0 and r.error < checks.MODEL_TOLERANCE


@gpu
def test_gpu_overhead():
    with timing.shared_stream():
        rows = overhead.run(log=print, calls=20)
    assert len(rows) == 16
    for r in rows:
        assert r.status == "ok", (r.label, r.status, r.note)
        assert 0 < r.tilekit_ms < 100


@gpu
def test_gpu_tuning_tiny():
    """The tuned-vs-untuned suite on a 2-layer model: both modes run, agree, and name their sources."""
    with timing.shared_stream():
        rows = tuning.run_preset("tiny", ((2, 64),), (1,), print, config=TINY)
    assert [(r.name, r.anchor) for r in rows] == [("prefill", tuning.UNTUNED), ("generate", tuning.UNTUNED)]
    for r in rows:
        assert r.status == "ok", (r.label, r.status, r.note)
        assert r.tilekit_ms > 0 and r.anchor_ms > 0 and "default" in r.note
    assert rows[0].error < checks.MODEL_TOLERANCE

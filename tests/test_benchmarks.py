"""CPU tests of the benchmark harness: arguments, arithmetic, checks, table, JSON / CSV, charts."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import checks, cli, kernels, model, report, system, timing, tuning
from benchmarks.report import Row
from tilekit.models.config import PRESETS, GPTConfig

ROOT = Path(__file__).resolve().parents[1]


# -- arguments ----------------------------------------------------------------------------------

def test_default_arguments():
    a = cli.parse_args([])
    assert (a.mode, a.out, a.only, a.no_plots) == ("quick", Path("bench-results"), None, False)


def test_mode_only_out_and_plots():
    a = cli.parse_args(["--full", "--only", "model", "--out", "/tmp/x", "--no-plots"])
    assert (a.mode, a.only, a.out, a.no_plots) == ("full", "model", Path("/tmp/x"), True)
    assert cli.parse_args(["--quick", "--only", "kernels"]).only == "kernels"


@pytest.mark.parametrize("argv", [["--quick", "--full"], ["--only", "layers"], ["--bogus"]])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2


def test_help_runs_without_gpu_libraries():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--quick" in out.stdout and "--only" in out.stdout
    probe = ("import sys, benchmarks.cli, benchmarks.__main__; "
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
    # 124.4M bf16 parameters at 3000 GB/s: 248.9 MB / 3e12 B/s = 0.08296 ms
    assert report.decode_floor_ms(124_439_808, 3000.0) == pytest.approx(0.082960, rel=1e-4)
    assert report.decode_floor_ms(1000, 1.0, bytes_per_param=4) == pytest.approx(4e-3)


def test_prefill_flops():
    c = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=10, block_size=16)
    B, T = 3, 5
    matmuls = 2 * B * T * (2 * (8 * 24 + 8 * 8 + 8 * 32 + 32 * 8) + 10 * 8)
    attention = 2 * (2 * B * T * T * 8)        # per layer: QK^T and PV, 2*B*T*T*C each, halved by causality
    assert report.prefill_flops(c, B, T) == pytest.approx(matmuls + attention)


def test_fill_times_and_roofline():
    r = Row("kernels", "linear", "l", "s", "torch.matmul", unit="TFLOP/s", work=2e12, roofline=800.0)
    report.fill_times(r, {"median_ms": 4.0, "p10_ms": 3.9, "p90_ms": 4.2, "reps": 30},
                      {"median_ms": 5.0, "p10_ms": 4.8, "p90_ms": 5.5, "reps": 30})
    assert r.tilekit_perf == pytest.approx(500.0) and r.anchor_perf == pytest.approx(400.0)
    assert r.pct_roofline == pytest.approx(62.5) and r.ratio == pytest.approx(1.25)
    assert (r.tilekit_p10_ms, r.anchor_p90_ms) == (3.9, 5.5)


def test_summarize():
    s = timing.summarize([3.0, 1.0, 2.0, 4.0, 5.0])
    assert s["median_ms"] == 3.0 and s["reps"] == 5 and s["p10_ms"] < s["median_ms"] < s["p90_ms"]
    with pytest.raises(ValueError):
        timing.summarize([])


def test_per_token():
    t = model._per_token({"median_ms": 256.0, "p10_ms": 128.0, "p90_ms": 512.0, "reps": 3}, 128)
    assert t == {"median_ms": 2.0, "p10_ms": 1.0, "p90_ms": 4.0, "reps": 3}


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

def test_kernel_plans():
    quick, full = kernels.plan("quick"), kernels.plan("full")
    assert set(quick) <= set(full) and len(quick) < len(full)
    kinds = {c.kind for c in quick}
    assert kinds == {"linear", "linear_gelu", "attention", "layer_norm", "gelu", "decode_attention"}
    linear = [c.params for c in full if c.kind == "linear"]
    assert ("gpt2-xl", "mlp.c_proj", 8192, 6400, 1600) in linear and len(linear) == 8
    assert {c.params[:3] for c in full if c.kind == "attention"} == {(8, 12, 1024), (1, 25, 1024), (4, 16, 4096)}
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
    for p in model.plan("full"):
        labels += [model.prefill_label(p.preset, B, T) for B, T in p.prefill]
        labels += [model.decode_label(p.preset, B) for B in p.decode]
    assert len(set(labels)) == len(labels)
    assert max(map(len, labels)) <= width, max(labels, key=len)


def test_model_plans():
    quick, full = model.plan("quick"), model.plan("full")
    assert [p.preset for p in quick] == ["gpt2", "gpt2-xl"] == [p.preset for p in full]
    assert quick[0].prefill == ((1, 128), (8, 1024)) and quick[1].prefill == ((8, 1024),)
    assert len(full[0].prefill) == 6 and full[0].decode == (1, 8) and full[0].compile
    assert not any(p.compile for p in quick)
    assert all(128 + 128 <= GPTConfig.preset(p.preset).block_size for p in full)


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
                 "torch.sdpa", error=float("inf"), tolerance=2e-2, status="failed",
                 note="relative error inf >= tolerance 0.02")
    err = Row("model", "prefill", "prefill gpt2-xl B8 T1024", "B=8 T=1024", "HF compile", status="error",
              note="RuntimeError: " + "very long message " * 20)
    skipped = Row("model", "prefill", "prefill gpt2 B1 T128", "B=1 T=128", "HF compile", status="skipped",
                  note="torch.compile budget spent")
    dec = Row("model", "generate", "generate gpt2-xl B8 128+128", "B=8", "HF sdpa", unit="tok/s",
              tilekit_ms=3.1, anchor_ms=25.0, tilekit_perf=8 / 3.1e-3, anchor_perf=8 / 25e-3,
              roofline=1.04, pct_roofline=100 * 1.04 / 3.1, params={"greedy_agreement": 17})
    return [ok, bw, failed, err, skipped, dec]


META = {"mode": "quick", "gpu": {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132},
        "calibration": {"copy_bandwidth_gbs": 2950.4, "matmul_peak_tflops": 765.2}}


def test_table_fits_100_columns():
    text = report.format_table(fake_rows(), META)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert "NVIDIA H100" in lines[0]
    assert "FAILED" in text and "ERROR" in text and "SKIP" in text
    assert "0.90x" in text and "1.25x" in text and "8.06x" in text    # 0.19/0.21, 0.1/0.08, 25/3.1
    assert "not measured:" in text and "torch.compile budget spent" in text
    assert lines[-1].startswith("3/6 rows measured")
    assert text.index("kernels:") < text.index("model prefill") < text.index("model decode")


def test_table_of_nothing():
    assert "0/0 rows measured" in report.format_table([], {})


def test_json_and_csv(tmp_path):
    rows = fake_rows()
    report.write_json(tmp_path / "results.json", META, rows)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["gpu"]["name"] == "NVIDIA H100 80GB HBM3"
    assert "decode_floor_ms" in doc["definitions"] and "ratio" in doc["definitions"]
    assert len(doc["rows"]) == len(rows)
    assert doc["rows"][0]["ratio"] == pytest.approx(0.19 / 0.21)
    assert doc["rows"][2]["error"] == "inf" and doc["rows"][2]["tilekit_ms"] is None
    report.write_csv(tmp_path / "results.csv", rows)
    with open(tmp_path / "results.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) and tuple(got[0]) == report.CSV_FIELDS
    assert float(got[1]["ratio"]) == pytest.approx(1.25)
    assert got[2]["status"] == "failed" and got[2]["tilekit_ms"] == ""
    assert json.loads(got[5]["params"]) == {"greedy_agreement": 17}


def test_exit_code():
    rows = fake_rows()
    assert report.exit_code(rows) == 1
    assert report.exit_code([r for r in rows if r.status in ("ok", "skipped")]) == 0


def test_write_outputs_without_plots(tmp_path):
    table = cli.write_outputs(tmp_path / "out", META, fake_rows(), plots=False, log=lambda m: None)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.csv", "results.json", "summary.txt"]
    assert (tmp_path / "out" / "summary.txt").read_text().strip() == table.strip()


def test_main_orchestration(tmp_path, monkeypatch, capsys):
    import contextlib
    calls = []
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(cli, "calibrate", lambda log: dict(META["calibration"]))
    monkeypatch.setattr(system, "environment", lambda mode, argv: {"mode": mode, "argv": argv, "gpu": dict(META["gpu"])})
    monkeypatch.setattr(system, "nvidia_smi", lambda bus=None: {})
    monkeypatch.setattr(timing, "shared_stream", contextlib.nullcontext)
    monkeypatch.setattr(kernels, "run", lambda mode, cal, log: calls.append(("kernels", mode)) or fake_rows()[:2])
    monkeypatch.setattr(model, "run", lambda mode, cal, log: calls.append(("model", mode)) or fake_rows()[5:])
    monkeypatch.setattr(tuning, "run", lambda mode, log: calls.append(("tuning", mode)) or [])
    out = tmp_path / "res"
    assert cli.main(["--full", "--out", str(out), "--no-plots"]) == 0
    assert calls == [("kernels", "full"), ("model", "full"), ("tuning", "full")]
    stdout = capsys.readouterr().out
    assert stdout.rstrip().splitlines()[-1].startswith("3/3 rows measured")
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["mode"] == "full" and doc["meta"]["calibration"]["matmul_peak_tflops"] == 765.2
    assert "elapsed_s" in doc["meta"] and len(doc["rows"]) == 3
    calls.clear()
    assert cli.main(["--only", "kernels", "--out", str(out), "--no-plots"]) == 0
    assert calls == [("kernels", "quick")]


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


def test_charts(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plots
    made = plots.write_all(fake_rows(), META, tmp_path)
    assert [p.name for p in made] == ["ratio.png", "roofline.png"]
    assert all(p.stat().st_size > 1000 for p in made)


def test_smi_parsing():
    text = ("name, clocks.current.sm [MHz], clocks.current.memory [MHz], clocks.max.sm [MHz], driver_version\n"
            "NVIDIA H200, 1980 MHz, 3201 MHz, 1980 MHz, 580.159.03\n")
    d = system.parse_smi_csv(text)
    assert d == {"name": "NVIDIA H200", "clocks.current.sm": "1980 MHz", "clocks.current.memory": "3201 MHz",
                 "clocks.max.sm": "1980 MHz", "driver_version": "580.159.03"}
    assert system.parse_smi_csv("") == {}


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
gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"GPU smoke test: {GPU_REASON}")
CALIB = {"copy_bandwidth_gbs": 3000.0, "matmul_peak_tflops": 800.0}


@gpu
def test_gpu_timer_streams_and_calibration():
    import torch
    with timing.shared_stream() as s:
        assert s.ptr == torch.cuda.current_stream().cuda_stream
        a = torch.randn(1024, 1024, device="cuda")
        t = timing.measure(lambda: a @ a, flush_l2=True, warmup=1, reps=5)
        assert t["reps"] == 5 and 0 < t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
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
    from tilekit.kernels.arrays import random_array
    c = random_array((64, 64), "bfloat16", 0, cupy.random.default_rng(0))
    widened = checks.bf16_bits_to_f64(c.view(cupy.uint16), cupy)
    assert checks.rel_error(c, widened) == 0.0 and checks.rel_error(c.T, widened.T) == 0.0


SMALL_CASES = [kernels.Case("linear", ("tiny", "x", 256, 128, 384)),
               kernels.Case("linear_gelu", ("tiny", "x", 256, 128, 512)),
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
        allowed = ("ok", "skipped") if r.anchor == "cupy.matmul" else ("ok",)
        assert r.status in allowed, (r.anchor, r.status, r.note)
        if r.status == "ok":
            assert r.tilekit_ms > 0 and r.anchor_ms > 0 and r.error < r.tolerance and r.tilekit_perf > 0


@gpu
def test_gpu_model_tiny():
    pytest.importorskip("transformers")
    config = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=1000, block_size=512)
    p = model.ModelPlan("tiny", prefill=((2, 64),), decode=(1,), prefill_reps=2, config=config)
    with timing.shared_stream():
        rows = model.run_preset(p, CALIB, log=print)
    assert [(r.name, r.anchor) for r in rows] == [("prefill", "HF sdpa"), ("prefill", "HF eager"),
                                                  ("generate", "HF sdpa"), ("generate", "HF eager")]
    for r in rows:
        assert r.status == "ok", (r.label, r.anchor, r.status, r.note)
        assert r.tilekit_ms > 0 and r.anchor_ms > 0 and r.pct_roofline is not None
    assert all(r.error < 5e-2 for r in rows if r.name == "prefill")


@gpu
def test_gpu_tuning_tiny():
    """The tuned-vs-untuned suite on a 2-layer model: both modes run, agree, and name their sources."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=1000, block_size=512)
    with timing.shared_stream():
        rows = tuning.run_preset("tiny", ((2, 64),), (1,), print, config=config)
    assert [(r.name, r.anchor) for r in rows] == [("prefill", tuning.UNTUNED), ("generate", tuning.UNTUNED)]
    for r in rows:
        assert r.status == "ok", (r.label, r.status, r.note)
        assert r.tilekit_ms > 0 and r.anchor_ms > 0 and "default" in r.note
    assert rows[0].error < checks.MODEL_TOLERANCE


def test_markdown_table_from_the_committed_run():
    """The README's results table is rendered from docs/results/results.json, row for row."""
    import json
    from pathlib import Path

    from benchmarks.markdown import render
    results = json.loads((Path(__file__).resolve().parents[1] / "docs/results/results.json").read_text())
    text = render(results)
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(table) == len(results["rows"])
    assert results["meta"]["gpu"]["name"] in text
    first = results["rows"][0]
    assert f"{first['tilekit_ms']:.3f}" in table[0] and f"{first['ratio']:.2f}x" in table[0]


def test_markdown_suite_filter_and_tuning_table():
    """--suite keeps one suite's rows; tuning rows get their own columns and name their config sources."""
    import json
    from pathlib import Path

    from benchmarks.markdown import main, render
    docs = Path(__file__).resolve().parents[1] / "docs/results"
    results = json.loads((docs / "results.json").read_text())
    kernels_only = render(results, "kernels")
    n_kernel_rows = sum(r["suite"] == "kernels" for r in results["rows"])
    assert sum(line.startswith("| ") for line in kernels_only.splitlines()) == n_kernel_rows + 1
    assert "prefill" not in kernels_only
    tuning = json.loads((docs / "tuning-h200.json").read_text())
    text = render(tuning)
    assert "TILEKIT_AUTOTUNE=off" in text and "shipped" in text
    first = tuning["rows"][0]
    assert f"| {first['label']} | {first['anchor_ms']:.3f} | {first['tilekit_ms']:.3f} | {first['ratio']:.2f}x |" in text
    with pytest.raises(SystemExit):
        main([str(docs / "results.json"), "--suite", "bogus"])

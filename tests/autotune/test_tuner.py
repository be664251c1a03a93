"""Tuning on the GPU: results are measured, stored, reused by another process, and hit the compile cache."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

cupy = pytest.importorskip("cupy")

from tilekit.autotune import store  # noqa: E402
from tilekit.autotune.tuner import tune  # noqa: E402
from tilekit.device import device_info  # noqa: E402
from tilekit.kernels import layer_norm  # noqa: E402
from tilekit.kernels.checks import TOL, assert_close, host, rand  # noqa: E402
from tilekit.kernels.layer_norm import LAYER_NORM, layer_norm_reference  # noqa: E402
from tilekit.kernels.linear import LINEAR  # noqa: E402

pytestmark = pytest.mark.gpu
SMALL = dict(dtype="bfloat16", M=512, N=256, K=256, wt="kn", bias=1, act="none", res=0, tf32=0)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_tuning_stores_the_fastest_and_another_process_uses_it(isolated_cache):
    result = tune(LINEAR, SMALL)
    assert result.measured >= 2
    assert result.time_us > 0 and LINEAR.space.contains(result.config)
    if result.default_time_us is not None:   # the winner is at least as fast as the default, within noise
        assert result.time_us <= result.default_time_us * 1.05
    entries = store.user_db().file_for(device_info()).read()
    (key, entry), = entries.items()
    assert entry["config"] == result.config and entry["time_us"] == pytest.approx(result.time_us, rel=1e-3)

    out = run_python(f"""
        import json
        from tilekit.kernels.linear import LINEAR
        from tilekit.device import device_info
        p = {SMALL!r}
        r = LINEAR.resolve(p, device_info())
        print(json.dumps({{"source": r.source, "config": r.config, "how": r.describe()}}))
    """, {"TILEKIT_CACHE_DIR": str(isolated_cache), "TILEKIT_AUTOTUNE": "cached"})
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["source"] == "user" and seen["config"] == result.config, seen
    assert "exact-gpu" in seen["how"] and "exact bucket" in seen["how"]


def test_auto_mode_tunes_a_missing_key_once(isolated_cache, monkeypatch):
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "auto")
    problem = dict(SMALL, M=100, N=128, K=64)
    r = LINEAR.resolve(problem, device_info())
    assert r.source == "tuned"
    again = LINEAR.resolve(problem, device_info())
    assert again.source == "user" and again.config == r.config


def test_precompiled_configs_are_cache_hits_for_the_jit(tmp_path):
    """Worker-process AOT compiles must produce the very cubins the JIT launch looks up."""
    out = run_python("""
        import cupy
        import cuda.tile as ct
        from cutile_cache._cache import cache_entries
        import tilekit.kernels
        from tilekit.autotune.compile import precompile
        from tilekit.autotune.registry import registered_ops
        from tilekit.device import device_info
        from tests.kernels.test_search_spaces import OPS, SPACE_CASES
        import os
        cache = os.environ["CUDA_TILE_CACHE_DIR"]
        ops = registered_ops()
        cases = [(OPS[n].name, p) for n, p in SPACE_CASES.items()] + [
            ("embedding", dict(dtype="bfloat16", ids="int32", M=100, C=768, V=1031, P=64, fixed=0)),
            ("embedding", dict(dtype="bfloat16", ids="int32", M=8, C=768, V=1031, P=64, fixed=1)),
            ("write_kv", dict(dtype="bfloat16", B=2, H=3, T=5, capacity=64, D=64, fp8=0))]
        tasks = []
        for n, p in cases:
            op = ops[n]
            problem = op.tuning_problem(p)
            tasks.append((op, problem, op.default(problem)))
        ok, errors = precompile(tasks, device_info().arch, workers=4)
        assert not errors, errors
        before = sum(1 for _ in cache_entries(cache))
        stream = cupy.cuda.get_current_stream()
        for op, problem, config in tasks:
            case = op.bench_case(problem)
            ct.launch(stream, case.grid(config), op.hinted(config), case.args(config))
        stream.synchronize()
        after = sum(1 for _ in cache_entries(cache))
        print(before, after, len(tasks))
    """, {"CUDA_TILE_CACHE_DIR": str(tmp_path / "cutile-cache")})
    before, after, n = map(int, out.split()[-3:])
    assert before >= n and after == before, f"JIT compiled {after - before} of {n} kernels again"


UNGUARDED = """
import os, sys
print("top level ran", flush=True)        # a spawned worker that re-ran this script would print it again
import numpy as np
from tilekit.kernels import layer_norm
from tilekit.kernels.checks import rand, host
from tilekit.kernels.layer_norm import layer_norm_reference
x, w, b = rand((3000, 768), "bfloat16"), rand((768,), "bfloat16"), rand((768,), "bfloat16")
y = layer_norm(x, w, b)
err = np.linalg.norm(host(y) - layer_norm_reference(host(x), host(w), host(b))) / np.linalg.norm(host(y))
print("relative error", err)
"""


def test_auto_mode_from_an_unguarded_user_script(isolated_cache, tmp_path):
    """A plain script (no __main__ guard) calling a public op in auto mode: tuned once, the right
    answer, the script not re-run by the compile workers, no deadlock."""
    script = tmp_path / "user_script.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "TILEKIT_AUTOTUNE": "auto", "TILEKIT_CACHE_DIR": str(isolated_cache),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("top level ran") == 1, done.stdout
    err = float(done.stdout.split("relative error")[-1])
    assert err < TOL["bfloat16"]
    store.reset()
    entries = store.user_db().file_for(device_info()).read()
    assert any(k.startswith("layer_norm/M=4096,N=768") for k in entries), list(entries)


def test_auto_mode_through_public_ops_in_process(isolated_cache, monkeypatch):
    monkeypatch.setenv("TILEKIT_AUTOTUNE", "auto")
    store.reset()
    x, w, b = rand((777, 333), "float32"), rand((333,), "float32"), rand((333,), "float32")
    y = layer_norm(x, w, b)
    assert_close(host(y), layer_norm_reference(host(x), host(w), host(b)), TOL["float32"], "auto layer_norm")
    r = LAYER_NORM.resolve(dict(dtype="float32", M=777, N=333, gather=0, fixed=0), device_info())
    assert r.source == "user" and r.match.exact


def test_an_op_tuned_whole_times_all_its_launches(isolated_cache):
    """next_token (tune_whole): every candidate is measured over scan and finish together, and a sampled key's
    time exceeds the scan alone of the same config."""
    import cuda.tile as ct

    from tilekit.autotune.space import split_hints
    from tilekit.kernels.next_token import NEXT_TOKEN
    problem = NEXT_TOKEN.tuning_problem(dict(dtype="bfloat16", B=1, V=50257, pen=0, KS=64, check=0))
    result = tune(NEXT_TOKEN, problem)
    assert result.measured == result.candidates and NEXT_TOKEN.space.contains(result.config)
    case = NEXT_TOKEN.bench_case(problem)
    assert [k for k, _, _ in case.launches(result.config)][0] is NEXT_TOKEN.hinted(result.config)
    scan = ct.tune.exhaustive_search([result.config], cupy.cuda.get_current_stream(), case.grid, NEXT_TOKEN.kernel,
                                     case.args, lambda c: split_hints(c)[1], quiet=True)
    assert result.time_us > scan.best.mean_us


def test_db_check_runs_entries_against_the_default_and_retunes_those_that_disagree(isolated_cache, monkeypatch,
                                                                                  capsys):
    """`tilekit db check`: an entry whose config agrees passes; one the check rejects (planted here: no config
    is known to stay miscompiled) is listed with exit 1, and --retune replaces it with what the tuner keeps."""
    from tilekit import cli
    from tilekit.autotune import tuner
    dev = device_info()
    tune(LINEAR, SMALL)
    (key, entry), = store.user_db().file_for(dev).read().items()
    problem = LINEAR.tuning_problem(SMALL)
    default = LINEAR.default(problem)
    other = next(c for c in LINEAR.space.candidates(problem) if c != default)
    store.user_db().store(dev, {key: {**entry, "config": other}})
    assert cli.main(["db", "check", "--layer", "user"]) == 0
    assert "1 of 1 entries agree" in capsys.readouterr().out

    def planted(case, configs, reference, runs=3, **_):      # (deadline, name: the hang watch's)
        return [reference], [(c, "WrongOutput", "planted disagreement") for c in configs if c != reference]
    monkeypatch.setattr(tuner, "agreeing", planted)
    assert cli.main(["db", "check", "--layer", "user"]) == 1
    out = capsys.readouterr().out
    assert f"WRONG   {key}: {other}: planted disagreement" in out and "0 of 1 entries agree" in out
    assert cli.main(["db", "check", "--layer", "user", "--retune"]) == 0
    store.reset()
    assert store.user_db().file_for(dev).read()[key]["config"] == default

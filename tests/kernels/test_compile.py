"""CI's proof that every kernel compiles: each op's default and a sample of its space, for sm_90 and sm_100,
built ahead of time by tileiras on this CPU-only machine."""

import random

import pytest

import tilekit.kernels  # noqa: F401  (declares the ops)
from tilekit.autotune.compile import describe_error, precompile
from tilekit.autotune.registry import registered_ops

PROBLEMS = {
    "linear": [dict(dtype="bfloat16", M=8192, N=2304, K=768, wt="kn", bias=1, act="gelu", res=0, tf32=0),
               dict(dtype="float32", M=3, N=1031, K=72, wt="nk", bias=0, act="none", res=1, tf32=1)],
    "layer_norm": [dict(dtype="bfloat16", M=8192, N=1600, gather=0, fixed=0),
                   dict(dtype="float32", M=3, N=20000, gather=0, fixed=0),
                   dict(dtype="bfloat16", M=8, N=768, gather=1, fixed=0),
                   dict(dtype="bfloat16", M=1, N=1600, gather=0, fixed=1),
                   dict(dtype="float32", M=3, N=1600, gather=1, fixed=1)],
    "residual_linear": [dict(dtype="bfloat16", M=1, N=1600, K=6400, bias=1),
                        dict(dtype="float32", M=5, N=1031, K=72, bias=0)],
    "gelu": [dict(dtype="float16", n=1 << 20, exact=1), dict(dtype="float32", n=7, exact=0)],
    "attention": [dict(dtype="bfloat16", B=8, H=12, Hkv=12, Tq=1024, Tk=1024, D=64, causal=1),
                  dict(dtype="float16", B=1, H=2, Hkv=2, Tq=7, Tk=9, D=128, causal=0),
                  dict(dtype="bfloat16", B=1, H=32, Hkv=8, Tq=128, Tk=128, D=64, causal=1)],
    "decode_attention": [dict(dtype="bfloat16", B=1, H=25, Hkv=25, nq=1, capacity=1024, D=64, new_kv=1, fp8=0),
                         dict(dtype="float32", B=3, H=2, Hkv=2, nq=4, capacity=100, D=64, new_kv=0, fp8=0),
                         dict(dtype="bfloat16", B=8, H=32, Hkv=8, nq=1, capacity=1024, D=128, new_kv=1, fp8=0),
                         dict(dtype="bfloat16", B=1, H=12, Hkv=12, nq=1, capacity=256, D=64, new_kv=1, fp8=0),
                         dict(dtype="bfloat16", B=1, H=32, Hkv=8, nq=1, capacity=131072, D=128, new_kv=1, fp8=0),
                         dict(dtype="bfloat16", B=8, H=32, Hkv=8, nq=1, capacity=32768, D=128, new_kv=1, fp8=1),
                         dict(dtype="float32", B=3, H=2, Hkv=2, nq=4, capacity=100, D=64, new_kv=0, fp8=1)],
    "embedding": [dict(dtype="bfloat16", ids="int32", M=8192, C=1600, V=50257, P=1024, fixed=0),
                  dict(dtype="float32", ids="int64", M=1, C=64, V=1031, P=64, fixed=1),
                  dict(dtype="bfloat16", ids="int32", M=8, C=2048, V=128256, P=0, fixed=0)],
    "rms_norm": [dict(dtype="bfloat16", M=8192, N=2048, gather=0, res=1, fixed=0),
                 dict(dtype="float32", M=3, N=20000, gather=0, res=1, fixed=0),
                 dict(dtype="bfloat16", M=8, N=4096, gather=1, res=0, fixed=0),
                 dict(dtype="bfloat16", M=1, N=2048, gather=0, res=0, fixed=1),
                 dict(dtype="float32", M=3, N=4096, gather=1, res=0, fixed=1)],
    "apply_rope": [dict(dtype="bfloat16", table="float32", B=8, H=40, T=1024, D=64),
                   dict(dtype="float32", table="float32", B=1, H=3, T=1, D=80)],
    "swiglu_linear": [dict(dtype="bfloat16", M=8192, N=8192, K=2048), dict(dtype="float32", M=3, N=77, K=72),
                      dict(dtype="bfloat16", M=1, N=14336, K=4096)],
    "write_kv": [dict(dtype="bfloat16", B=8, H=12, T=1024, capacity=1024, D=64, fp8=0),
                 dict(dtype="float32", B=1, H=2, T=1, capacity=100, D=80, fp8=0),
                 dict(dtype="bfloat16", B=4, H=8, T=2048, capacity=2048, D=128, fp8=1),
                 dict(dtype="float16", B=1, H=2, T=5, capacity=100, D=80, fp8=1)],
    "next_token": [dict(dtype="bfloat16", B=8, V=128256, pen=1, KS=128, check=1, E=2),
                   dict(dtype="bfloat16", B=1, V=50257, pen=0, KS=64, check=0, E=1),
                   dict(dtype="float32", B=1, V=1031, pen=0, KS=0, check=0),
                   # the engine's picker: 256 candidate slots force 8192-wide chunks, 32 eos slots
                   dict(dtype="bfloat16", B=64, V=128256, pen=1, KS=256, check=1, E=32)],
    "moe_router": [dict(dtype="bfloat16", M=1, E=64, C=2048, K=6, shared=2, renorm=0),
                   dict(dtype="bfloat16", M=8192, E=160, C=5120, K=6, shared=2, renorm=1),
                   dict(dtype="float32", M=3, E=8, C=72, K=3, shared=0, renorm=0)],
    "moe_permute": [dict(P=8, E=66), dict(P=65536, E=66), dict(P=30, E=8)],
    "moe_gate_up": [dict(dtype="bfloat16", M=1, slots=8, E=66, I=1408, C=2048),
                    dict(dtype="bfloat16", M=8192, slots=8, E=66, I=1408, C=2048),
                    dict(dtype="float32", M=5, slots=3, E=8, I=40, C=72)],
    "moe_down_combine": [dict(dtype="bfloat16", M=1, slots=8, E=66, I=1408, C=2048),
                         dict(dtype="bfloat16", M=8192, slots=8, E=66, I=1408, C=2048),
                         dict(dtype="float32", M=5, slots=3, E=8, I=40, C=72)],
    "quant_linear": [dict(dtype="bfloat16", M=1, N=4096, K=4096, wq="int8", scale="channel", xq="none", act="none",
                          bias=0, res=1),
                     dict(dtype="bfloat16", M=8, N=14336, K=4096, wq="fp8", scale="channel", xq="none", act="swiglu",
                          bias=0, res=0),
                     dict(dtype="float16", M=5, N=1031, K=200, wq="fp8", scale="block", xq="none", act="none", bias=1,
                          res=1),
                     dict(dtype="bfloat16", M=8192, N=4096, K=4096, wq="fp8", scale="channel", xq="fp8", act="none",
                          bias=0, res=1),
                     dict(dtype="bfloat16", M=8192, N=14336, K=4096, wq="fp8", scale="block", xq="fp8", act="swiglu",
                          bias=0, res=0),
                     dict(dtype="float32", M=300, N=77, K=72, wq="int8", scale="block", xq="none", act="swiglu", bias=0,
                          res=0),
                     dict(dtype="bfloat16", M=1, N=4096, K=4096, wq="fp8", scale="block", xq="fp8", act="swiglu",
                          bias=0, res=0)],
    "quantize_fp8": [dict(dtype="bfloat16", M=8192, K=4096, group=0), dict(dtype="bfloat16", M=8192, K=14336, group=1),
                     dict(dtype="float32", M=3, K=200, group=1), dict(dtype="float16", M=5, K=72, group=0)],
    "mla_decode_attention": [dict(dtype="bfloat16", B=1, H=16, nq=1, capacity=4096, R=512, P=64, new_kv=1),
                             dict(dtype="bfloat16", B=8, H=16, nq=1, capacity=256, R=512, P=64, new_kv=1),
                             dict(dtype="float32", B=2, H=4, nq=3, capacity=100, R=32, P=16, new_kv=0)],
    "paged_mla_decode_attention": [dict(dtype="bfloat16", B=64, H=16, nq=1, capacity=4096, R=512, P=64, new_kv=1,
                                        block=64),
                                   dict(dtype="bfloat16", B=2048, H=16, nq=1, capacity=4096, R=512, P=64, new_kv=0,
                                        block=16),
                                   dict(dtype="float32", B=3, H=4, nq=1, capacity=128, R=32, P=16, new_kv=1, block=32)],
    "fixed_cast": [dict(dtype="bfloat16", M=1, N=2048), dict(dtype="float32", M=8192, N=77)],
    "head_linear": [dict(dtype="bfloat16", M=1, H=16, N=512, K=128, wt="kn"),
                    dict(dtype="bfloat16", M=32, H=16, N=128, K=512, wt="nk"),
                    dict(dtype="float32", M=5, H=3, N=40, K=24, wt="nk")],
    "paged_write_kv": [dict(dtype="bfloat16", T=2048, H=8, D=128, fp8=0), dict(dtype="float32", T=5, H=2, D=80, fp8=0),
                       dict(dtype="bfloat16", T=64, H=8, D=128, fp8=1)],
    "paged_decode_attention": [dict(dtype="bfloat16", B=64, H=32, Hkv=8, nq=1, capacity=8192, D=128, new_kv=1,
                                    fp8=0, block=64),
                               dict(dtype="bfloat16", B=1, H=12, Hkv=12, nq=1, capacity=1024, D=64, new_kv=1, fp8=0,
                                    block=64),
                               dict(dtype="float32", B=3, H=2, Hkv=2, nq=1, capacity=128, D=64, new_kv=1, fp8=0,
                                    block=32),
                               dict(dtype="bfloat16", B=8, H=32, Hkv=8, nq=1, capacity=4096, D=128, new_kv=1, fp8=1,
                                    block=64),
                               dict(dtype="float32", B=4, H=4, Hkv=4, nq=1, capacity=64, D=16, new_kv=1, fp8=0,
                                    block=16)],
    "paged_prefill_attention": [dict(dtype="bfloat16", T=8192, H=32, Hkv=8, D=128, fp8=0, block=64),
                                dict(dtype="bfloat16", T=512, H=12, Hkv=12, D=64, fp8=0, block=64),
                                dict(dtype="float32", T=70, H=2, Hkv=2, D=64, fp8=0, block=32),
                                dict(dtype="bfloat16", T=256, H=32, Hkv=8, D=128, fp8=1, block=64),
                                dict(dtype="float32", T=64, H=4, Hkv=4, D=16, fp8=0, block=16)],
    "token_bitmask": [dict(dtype="bfloat16", R=64, V=128256), dict(dtype="float32", R=3, V=1031)],
    "mla_kv": [dict(dtype="bfloat16", M=8192, H=16, DN=128, DV=128, P=64),
               dict(dtype="float32", M=5, H=3, DN=16, DV=8, P=16)],
}


def test_every_op_has_compile_cases():
    declared = {n for n, op in registered_ops().items() if op.kernel._pyfunc.__module__.startswith("tilekit.kernels")}
    assert set(PROBLEMS) == declared


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_defaults_and_space_samples_compile(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path / "cutile"))   # really run tileiras
    ops = registered_ops()
    tasks = []
    for name, problems in PROBLEMS.items():
        op = ops[name]
        for problem in problems:
            bucketed = op.tuning_problem(problem)
            candidates = op.space.candidates(bucketed)
            assert candidates, f"{name}: empty search space for {problem}"
            assert op.space.contains(op.default(bucketed)), f"{name}: default outside its space"
            sample = random.Random(arch).sample(candidates, min(2, len(candidates)))
            tasks += [(op, bucketed, c) for c in [op.default(bucketed)] + sample]
    split_k = ops["linear"]
    tasks += [(split_k, dict(PROBLEMS["linear"][0], M=8, act="gelu", res=1),   # few rows: split-K's own path
               dict(TM=16, TN=64, TK=128, GROUP_M=8, SPLIT_K=4, PERSISTENT=0, occupancy=1, num_ctas=1,
                    num_worker_warps=0))]
    decode = ops["decode_attention"]     # the space's ends: the shortest splits, the longest
    tasks += [(decode, decode.tuning_problem(PROBLEMS["decode_attention"][4]), dict(BN=64, PROGRAMS=4096, occupancy=1)),
              (decode, decode.tuning_problem(PROBLEMS["decode_attention"][4]), dict(BN=128, PROGRAMS=1, occupancy=4))]
    mla = ops["mla_decode_attention"]
    tasks += [(mla, mla.tuning_problem(PROBLEMS["mla_decode_attention"][0]), dict(HP=16, BN=32, CHUNK=4096, occupancy=1))]
    quant = ops["quant_linear"]
    few = dict(GROUP_M=8, SPLIT_K=4, PROMOTE=1, occupancy=1, num_worker_warps=0)
    extra = [(quant, quant.tuning_problem(p), c) for p, c in [      # each product and promotion interval
        (PROBLEMS["quant_linear"][0], dict(few, MODE=2, TM=1, TN=32, TK=512)),
        (dict(PROBLEMS["quant_linear"][1], M=4, scale="block", xq="fp8"),
         dict(few, SPLIT_K=1, MODE=2, TM=4, TN=16, TK=128)),
        (dict(PROBLEMS["quant_linear"][1], scale="block", xq="fp8"), dict(few, SPLIT_K=1, MODE=1, TM=16, TN=64,
                                                                           TK=128)),
        (dict(PROBLEMS["quant_linear"][2], K=208, scale="channel"), dict(few, MODE=1, TM=16, TN=32, TK=128,
                                                                          SPLIT_K=2)),
        (PROBLEMS["quant_linear"][3], dict(few, SPLIT_K=1, MODE=0, TM=128, TN=128, TK=64, PROMOTE=4,
                                           num_worker_warps=8)),
        (dict(PROBLEMS["quant_linear"][3], act="swiglu"), dict(few, SPLIT_K=1, MODE=0, TM=64, TN=64, TK=128,
                                                               PROMOTE=2)),
        (PROBLEMS["quant_linear"][3], dict(few, SPLIT_K=1, MODE=1, TM=128, TN=128, TK=128, num_worker_warps=8)),
        (PROBLEMS["quant_linear"][4], dict(few, SPLIT_K=1, MODE=1, TM=128, TN=64, TK=128, num_worker_warps=8)),
        (dict(PROBLEMS["quant_linear"][0], M=8192), dict(few, SPLIT_K=1, MODE=1, TM=128, TN=128, TK=64))]]
    assert all(op.space.contains(c) and c in op.space.candidates(p) for op, p, c in extra)
    tasks += extra
    ok, errors = precompile(tasks, arch, workers=2)
    assert not errors, "\n".join(f"{tasks[i][0].name} {tasks[i][2]}: {e}" for i, e in errors.items())
    assert len(ok) == len(tasks)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_the_peer_all_reduce_compiles(arch, tmp_path, monkeypatch):
    """The tensor-parallel all-reduce kernel (launched by tilekit.parallel, not an Op): each dtype class, fused
    norm or not, world sizes 2 and 8, rows past one program each and columns past one tile."""
    import io

    from cuda.tile.compilation import export_kernel

    from tilekit.autotune.arrays import ArraySpec
    from tilekit.autotune.compile import signature
    from tilekit.kernels import peer_all_reduce as par
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path / "cutile"))
    for M, N, dtype, world, norm in [(1, 4096, "bfloat16", 2, True), (8, 2048, "int64", 2, False),
                                     (200, 96, "float32", 8, False), (2, 16384, "float16", 4, False)]:
        x, box = ArraySpec(dtype, (M, N)), ArraySpec(dtype, (2, world, M, N))
        flags = ArraySpec("int32", (world * par.PROGRAMS,))
        _, args = par.launch_args(x, x, box, [box] * (world - 1), flags, [flags] * (world - 1),
                                  ArraySpec("int32", (par.PROGRAMS,)), ArraySpec(dtype, (N,)), x, 0, 1e-5, norm)
        cubin = io.BytesIO()
        export_kernel(par.peer_all_reduce_kernel, [signature(par.peer_all_reduce_kernel, args)], cubin,
                      gpu_code=arch, output_format="cubin")
        assert cubin.getvalue(), (M, N, dtype, world, norm)


def test_workers_do_not_rerun_an_unguarded_script(tmp_path):
    """A user's script without a __main__ guard that compiles in worker processes (as auto mode
    does): the workers import tilekit, not the script."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "user_script.py"
    script.write_text(
        'print("top level ran", flush=True)\n'
        "from tilekit.kernels.gelu import GELU, default_config\n"
        "from tilekit.autotune.compile import precompile\n"
        'p = dict(dtype="float32", n=1000, exact=0)\n'
        'ok, errors = precompile([(GELU, p, default_config(p))] * 2, "sm_90", workers=2)\n'
        'print("compiled", len(ok), errors)\n')
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "CUDA_TILE_CACHE_DIR": str(tmp_path / "cutile"),
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("top level ran") == 1, done.stdout
    assert "compiled 2 {}" in done.stdout, done.stdout


def test_a_compile_error_that_cannot_format_itself_is_still_reported():
    """tileiras failures on sm_100 raised cuTile errors whose str() fails (no source location): precompile must
    report them as rejected configs, not crash."""
    class Unprintable(Exception):
        message = "failed to compile Tile IR program"

        def __str__(self):
            raise AttributeError("'NoneType' object has no attribute 'name'")

    assert describe_error(Unprintable()) == "Unprintable: failed to compile Tile IR program"
    assert describe_error(ValueError("bad tile")) == "ValueError: bad tile"


def test_collected_launches_compile_once_each_as_the_jit_sees_them(tmp_path, monkeypatch):
    """precompile_launches (an engine's start-up): launches collected from plans, their device arrays described by
    dtype, shape, strides and alignment, repeated launches compiled once, each into cuTile's cache."""
    from tilekit.autotune.arrays import ArraySpec, MetaArray
    from tilekit.autotune.compile import launch_job, precompile_launches, signature
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path / "cutile"))
    ops = registered_ops()
    collected = []
    for name, problem in (("rms_norm", PROBLEMS["rms_norm"][3]), ("decode_attention", PROBLEMS["decode_attention"][3])):
        op = ops[name]
        config = op.default(op.complete(problem))
        for kernel, args in op.compile_args(problem, config):
            seen = tuple(MetaArray(a.shape, a.dtype, a.element_strides()) if isinstance(a, ArraySpec) else a
                         for a in args)
            job = launch_job(op, config, kernel, seen)
            assert job[1] == name and job[3] == kernel._pyfunc.__name__
            assert signature(kernel, job[4]) == signature(kernel, args)
            collected += [(op, config, kernel, seen)] * 3          # every layer repeats its launches
    distinct = len({repr(launch_job(*c)) for c in collected})
    assert distinct == len(collected) // 3
    ended = []
    count, errors = precompile_launches(collected, "sm_90", workers=2, progress=lambda *a: ended.append(a))
    assert (count, errors) == (distinct, {})
    assert [a[:2] for a in ended] == [(i + 1, distinct) for i in range(distinct)]
    assert {a[2].split(".")[0] for a in ended} == {"rms_norm", "decode_attention"} and {a[3] for a in ended} == {None}
    assert any((tmp_path / "cutile").rglob("*")), "nothing reached cuTile's cache"
    assert precompile_launches(collected, "sm_90", workers=2) == (0, {})      # compiled ahead already: no pool


def test_a_strided_view_keeps_its_strides_in_the_compiled_signature():
    from tilekit.autotune.arrays import ArraySpec, MetaArray
    from tilekit.autotune.compile import launch_job
    op = registered_ops()["rms_norm"]
    problem = PROBLEMS["rms_norm"][3]
    config = op.default(op.complete(problem))
    kernel, args = op.compile_args(problem, config)[0]
    view = MetaArray((4, 8, 1, 64), "bfloat16", (64, 256, 64, 1))
    described = launch_job(op, config, kernel, (view,) + args[1:])[4][0]
    assert described == ArraySpec("bfloat16", (4, 8, 1, 64), (64, 256, 64, 1), aligned16=True)


def sleep_for(seconds: float) -> float:
    """A job for the worker pool (importable by its spawned workers): sleeps in a child process, as a compile runs
    its compiler."""
    import subprocess
    subprocess.run(["sleep", str(seconds)], check=True)
    return seconds


def sleepers(seconds: float) -> list[int]:
    """The pids of `sleep <seconds>` processes still running."""
    from pathlib import Path
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().split(b"\0")[:2] == [b"sleep", str(seconds).encode()]:
                found.append(int(cmdline.parent.name))
        except OSError:
            pass
    return found


def no_children_soon() -> bool:
    """Whether every worker process this test process started has ended (the pool's manager thread reaps them)."""
    import multiprocessing
    import time
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not multiprocessing.active_children()


def test_a_pool_past_its_deadline_stops_the_jobs_still_running():
    """A compile that never ends does not hold a start-up or a tuning run: at the deadline the workers still busy are
    stopped with the compilers they run, not waited for, and the jobs that finished are kept."""
    import time

    from tilekit.autotune.compile import _run_pool
    start = time.monotonic()
    ok, errors = _run_pool(sleep_for, [(0.0,), (611.5,), (0.0,)], 2, deadline=start + 30)
    assert ok == {0, 2} and errors == {}
    assert time.monotonic() - start < 60
    assert not sleepers(611.5) and no_children_soon()


def test_launches_not_precompiled_in_time_are_named_with_their_config(tmp_path, monkeypatch):
    from tilekit.autotune.arrays import ArraySpec, MetaArray
    from tilekit.autotune.compile import precompile_launches
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path / "cutile"))
    op = registered_ops()["rms_norm"]
    problem = PROBLEMS["rms_norm"][0]
    config = op.default(op.complete(problem))
    kernel, args = op.compile_args(problem, config)[0]
    seen = tuple(MetaArray(a.shape, a.dtype, a.element_strides()) if isinstance(a, ArraySpec) else a for a in args)
    taller = tuple(MetaArray((2 * a.shape[0],) + a.shape[1:], a.dtype) if isinstance(a, MetaArray) and len(a.shape) == 2
                   else a for a in seen)                  # the same launch at twice the rows: the same cubin
    assert taller[0].shape == (2 * seen[0].shape[0], seen[0].shape[1])
    count, errors = precompile_launches([(op, config, kernel, seen), (op, config, kernel, taller)], "sm_90",
                                        workers=2, timeout_s=0.001)
    assert count == 1
    assert errors == {0: f"rms_norm.{kernel._pyfunc.__name__} {config}: not compiled within 0.001 s"}


def test_ctrl_c_during_a_pool_stops_its_workers_at_once():
    """Ctrl-C while kernels compile (an engine's start-up, a tune) ends the pool now: the job still running is
    stopped with its compiler, not waited for, and the interrupt goes on to the caller."""
    import time

    from tilekit.autotune.compile import _run_pool

    def interrupt(i, error):
        raise KeyboardInterrupt

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _run_pool(sleep_for, [(0.0,), (612.5,)], 2, progress=interrupt)
    assert time.monotonic() - start < 60
    assert not sleepers(612.5) and no_children_soon()


def test_a_launch_that_fails_without_a_timeout_is_named():
    from tilekit.autotune.arrays import ArraySpec, MetaArray
    from tilekit.autotune.compile import precompile_launches
    op = registered_ops()["rms_norm"]
    problem = PROBLEMS["rms_norm"][1]
    config = op.default(op.complete(problem))
    kernel, args = op.compile_args(problem, config)[0]
    seen = tuple(MetaArray(a.shape, a.dtype, a.element_strides()) if isinstance(a, ArraySpec) else a for a in args)
    count, errors = precompile_launches([(op, config, kernel, seen[:-1])], "sm_90", workers=1)   # an argument short
    assert count == 1 and errors[0].startswith(f"rms_norm.{kernel._pyfunc.__name__} {config}: ")

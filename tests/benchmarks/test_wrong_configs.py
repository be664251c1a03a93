"""benchmarks.studies.wrong_configs on the CPU: one config per distinct set of launches of an op's whole grid (the
constraint left out), and bad arguments refused before anything touches a GPU."""

import pytest

import tilekit.kernels  # noqa: F401  (declares the ops)
from benchmarks.studies import wrong_configs
from tilekit.autotune.registry import registered_ops
from tilekit.autotune.space import split_hints


def _launch_set(op, problem, config):
    return (tuple((tuple(launch.constants(problem, config)), tuple(launch.grid(problem, config)))
                  for launch in op.launches), tuple(sorted(split_hints(config)[1].items())))


def test_distinct_configs_keep_one_config_per_launch_set_from_the_whole_grid():
    op = registered_ops()["decode_attention"]
    problem = op.tuning_problem(dict(dtype="bfloat16", B=1, H=32, Hkv=8, nq=1, capacity=2048, D=128, new_kv=1,
                                     fp8=0))
    kept = wrong_configs.distinct_configs(op, problem)
    sets = [_launch_set(op, problem, c) for c in kept]
    assert len(set(sets)) == len(sets)                                    # no two alike
    assert {_launch_set(op, problem, c) for c in op.space} == set(sets)   # every launch set of the grid
    outside = [c for c in kept if not op.space.admits(c, problem)]
    assert outside and len(kept) > len(op.space.candidates(problem))      # the constraint is left out
    assert any(c["occupancy"] == 2 for c in outside)                      # the classes the space excludes


@pytest.mark.parametrize("argv, words", [
    (["--kernel", "no_such_op", "--shape", "M=1"], "--kernel"),
    (["--kernel", "decode_attention", "--shape", "B=1,H=32"], "--shape"),
])
def test_bad_arguments_are_refused_before_any_gpu_work(argv, words, capsys):
    with pytest.raises(SystemExit):
        wrong_configs.main(argv)
    assert words in capsys.readouterr().err

"""benchmarks.studies.local_memory on the CPU without compiling: every case is a complete problem of its op and
every fixed config builds its launches (a case missing a key field, or a config of a retired space parameter, broke
the study when it ran)."""

import pytest

import tilekit.kernels  # noqa: F401  (declares the ops)
from benchmarks.studies.local_memory import CASES, LINEAR_PLAIN
from tilekit.autotune.registry import registered_ops


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cases_are_complete_problems_and_their_configs_build_launches(name, dtype):
    op = registered_ops()[name]
    for problem, fixed in CASES[name]:
        assert set(problem) | {"dtype"} == set(op.fields), sorted(set(op.fields) ^ set(problem) - {"dtype"})
        p = op.tuning_problem(dict(problem, dtype=dtype))
        for config in [op.default(p)] + [dict(LINEAR_PLAIN, **f) if name == "linear" else f for f in fixed]:
            assert list(op.compile_args(p, config)), (name, config)

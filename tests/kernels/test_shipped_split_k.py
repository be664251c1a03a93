"""Every shipped split-K config of the ops whose last program to arrive sums the others' partial products (linear,
quant_linear), run at its own shape on this GPU, several times on fresh inputs, against the float64 reference.

On 2026-11-26 the tuner rejected, for each few-row quant_linear shape it tuned, 4-11 split-K candidates with
occupancy 2 whose output differed from the default config's by 2-107% (and such linear candidates on the H200);
the configs shipped are ones that passed its single check. A sum that depends on timing would pass once and fail
on some later run: this test runs each shipped one repeatedly. (residual_linear and moe_down_combine add their
partials with integer atomics into a fixed-point stream: no arrival, no partial buffer.)"""

from pathlib import Path

import pytest

from tests.kernels.test_linear import check_linear
from tests.kernels.test_quant_linear import check_quant_linear
from tilekit.autotune.db import _parse, device_file_name
from tilekit.autotune.keys import parse_key
from tilekit.kernels.linear import LINEAR
from tilekit.kernels.quant_linear import QUANT_LINEAR

pytestmark = pytest.mark.gpu

SHIPPED = Path(__file__).resolve().parents[2] / "tuning_db"
RUNS = 8
OPS = {"linear": LINEAR, "quant_linear": QUANT_LINEAR}


def shipped_split_k() -> list[tuple[str, dict, dict]]:
    """(op name, problem, config) of every split-K entry of OPS in this GPU's shipped file."""
    from tilekit.device import device_info
    device = device_info()
    data, why = _parse(SHIPPED / device.arch / device_file_name(device.name))
    assert why is None, why
    found = []
    for key, entry in (data or {}).get("entries", {}).items():
        name, problem = parse_key(key)
        if name in OPS and entry["config"].get("SPLIT_K", 1) > 1:
            found.append((name, problem, entry["config"]))
    return found


def run_check(name: str, p: dict) -> None:
    if name == "linear":
        check_linear(p["M"], p["N"], p["K"], p["dtype"], layout="in_out" if p["wt"] == "kn" else "out_in",
                     bias=bool(p["bias"]), act=None if p["act"] == "none" else p["act"], res=bool(p["res"]),
                     tf32=bool(p["tf32"]))
    else:
        check_quant_linear(p["M"], p["N"], p["K"], p["dtype"], p["wq"], p["scale"], fp8_x=p["xq"] == "fp8",
                           swiglu=p["act"] == "swiglu", bias=bool(p["bias"]), res=bool(p["res"]))


def test_every_shipped_split_k_config_sums_right_every_time():
    cases = shipped_split_k()
    if not cases:
        pytest.skip("this GPU's shipped file holds no split-K linear or quant_linear entry")
    for name, problem, config in cases:
        with OPS[name].pinned(config):
            for run in range(RUNS):
                try:
                    run_check(name, problem)
                except AssertionError as e:
                    raise AssertionError(f"{name} {problem} with shipped {config}, run {run + 1}: {e}") from e

"""Which launches should be dependent: the replayed decode step with programmatic dependent launch on for all
kernels, off for all, off for one kernel at a time, and on for one at a time.

    python -m benchmarks.studies.launch_variants OUT.json MODEL [MODEL ...]

MODEL: a preset, optionally +int8 / +fp8 (its linears quantized per channel) and @B (the batch, default 1), e.g.
llama-3.1-8b+fp8@8.

Produced docs/results/dependent-launch-variants-h200.txt (its VAR lines); an experiment, not a suite.
"""

import json
import sys

from benchmarks.studies.breakdown import _decode_generation, decode_model, replay_ms
from tilekit.autotune import op

real = op.ct_launch


def name_of(k):
    f = getattr(k, "_pyfunc", None)
    return f.__name__ if f is not None else type(k).__name__


def use(off):
    """Launch through tilekit's plans as usual, but never dependently for kernels named in `off`."""
    def launch(h, g, k, a, programmatic_dependent_launch=False):
        return real(h, g, k, a, programmatic_dependent_launch=programmatic_dependent_launch and name_of(k) not in off)
    op.ct_launch = launch


seen = set()


def spy(h, g, k, a, programmatic_dependent_launch=False):
    seen.add(name_of(k))
    return real(h, g, k, a, programmatic_dependent_launch=programmatic_dependent_launch)


def parse(spec: str) -> tuple[str, str | None, int]:
    """'preset[+quantize][@batch]' -> (preset, quantize or None, batch)."""
    model, _, batch = spec.partition("@")
    preset, _, quantize = model.partition("+")
    return preset, quantize or None, int(batch or 1)


if __name__ == "__main__":
    out = {}
    for spec in sys.argv[2:]:
        preset, quantize, batch = parse(spec)
        model = decode_model(preset, quantize=quantize)
        op.ct_launch = spy
        _decode_generation(model, batch)
        names = sorted(seen)
        seen.clear()
        variants = ([("all-on", set()), ("all-off", set(names))] + [(f"off:{n}", {n}) for n in names]
                    + [(f"only:{n}", set(names) - {n}) for n in names] + [("all-on", set()), ("all-off", set(names))])
        res = []
        for label, off in variants:
            use(off)
            ms = replay_ms(_decode_generation(model, batch), reps=50)
            res.append((label, ms))
            print(f"VAR {spec:14s} {label:34s} {ms:.4f}", flush=True)
        out[spec] = res
        del model
    op.ct_launch = real
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)

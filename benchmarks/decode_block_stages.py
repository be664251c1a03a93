"""Where a decode_block launch's time goes: the one-launch GPT-2 block kernel timed with only some of
its seven stages enabled (the six barriers and the exit always run), per GPT-2 width, batch 1,
context 255 of a 256-position cache, random inputs; each time is per launch, replayed from a CUDA
graph of 10 launches (median of 3 replays), for the default config with each --config's overrides.
The kernels compile in parallel processes first.

    python -m benchmarks.decode_block_stages --model gpt2 --model gpt2-xl [--config JSON ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

MASKS = {"all stages": 127, "barriers only": 0, "ln_1 + ln_2": 1 | 16, "qkv": 2, "attention": 4, "proj": 8,
         "fc": 32, "mlp_proj": 64, "four projections": 2 | 8 | 32 | 64}


def _problem(preset: str, batch: int) -> dict:
    from benchmarks.model import model_config
    from tilekit.kernels.decode_block import DECODE_BLOCK
    c = model_config(preset)
    return DECODE_BLOCK.tuning_problem(dict(dtype="bfloat16", B=batch, C=c.n_embd, H=c.n_head, capacity=256))


def _args(problem: dict, config: dict, stages: int, case=None) -> tuple:
    """The launch's arguments with STAGES (the last constant) replaced: specs, or case's arrays."""
    from tilekit.kernels.decode_block import DECODE_BLOCK
    args = case.args(config) if case else DECODE_BLOCK.compile_args(problem, config)[0][1]
    return (*args[:-1], stages)


def compile_stages(problem: dict, config: dict, stages: int, arch: str) -> None:
    """Compile one masked kernel into cuTile's disk cache (a worker process runs this)."""
    from cuda.tile.compilation import export_kernel

    from tilekit.autotune.compile import signature
    from tilekit.kernels.decode_block import DECODE_BLOCK
    kernel, args = DECODE_BLOCK.hinted(config), _args(problem, config, stages)
    export_kernel(kernel, [signature(kernel, args)], io.BytesIO(), gpu_code=arch, output_format="cubin")


def time_stages(problem: dict, config: dict, stages: int, launches: int = 10, replays: int = 3) -> float:
    """Microseconds per launch of the kernel with `stages` on fresh random inputs."""
    import cupy
    import numpy as np
    from cuda.tile import launch

    from tilekit.kernels.decode_block import DECODE_BLOCK
    case = DECODE_BLOCK.bench_case(problem)
    kernel, grid, args = DECODE_BLOCK.hinted(config), case.grid(config), _args(problem, config, stages, case)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch(stream.ptr, grid, kernel, args)         # compile (a cache hit) and warm up
        stream.begin_capture()
        for _ in range(launches):
            launch(stream.ptr, grid, kernel, args)
        graph = stream.end_capture()
        graph.launch(stream)
        times = []
        for _ in range(replays):
            start, end = stream.record(), None
            graph.launch(stream)
            end = stream.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1000 / launches)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_block_stages", description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="model preset (repeatable; default gpt2 and gpt2-xl)")
    ap.add_argument("--config", type=json.loads, action="append",
                    help="decode_block config overrides as JSON (repeatable; default: the default config)")
    ap.add_argument("--stages", action="append", choices=list(MASKS),
                    help="which stage sets to time (repeatable; default all of them)")
    ap.add_argument("--out", type=Path, help="write decode_block_stages.json here")
    args = ap.parse_args(argv)
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from tilekit.device import device_info
    from tilekit.kernels.decode_block import DECODE_BLOCK
    cases = []
    for preset in args.model or ["gpt2", "gpt2-xl"]:
        problem = _problem(preset, 1)
        for overrides in args.config or [{}]:
            config = {**DECODE_BLOCK.default(problem), **overrides}
            cases += [(preset, problem, config, name, mask) for name, mask in MASKS.items()
                      if not args.stages or name in args.stages]
    arch = device_info(0).arch
    with ProcessPoolExecutor(min(15, len(cases)), mp_context=get_context("spawn")) as pool:
        for future in [pool.submit(compile_stages, p, c, m, arch) for _, p, c, _, m in cases]:
            future.result()
    rows = []
    for preset, problem, config, name, mask in cases:
        us = time_stages(problem, config, mask)
        rows.append(dict(preset=preset, config=config, stages=name, mask=mask, us=us))
        changed = {k: v for k, v in config.items() if DECODE_BLOCK.default(problem)[k] != v}
        print(f"{preset:8s} {str(changed or 'default'):24s} {name:18s} {us:8.1f} us per launch", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_block_stages.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

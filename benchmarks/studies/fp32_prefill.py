"""fp32 prefill of GPT-2 with the linear layers' untuned config against fixed candidate tiles, and against the
same weights' eager PyTorch forward (the Hugging Face model, sdpa, fp32, TF32 off), one process:

    python -m benchmarks.studies.fp32_prefill [--batch 1] [--seq 128]

fp32 has no tuned entries (the shipped databases hold bf16 and fp16), so every fp32 linear runs the heuristic
default; this shows what that default costs and which tile the default should be.
"""

from __future__ import annotations

import argparse
import sys

CANDIDATES = [dict(TM=128, TN=128, TK=64), dict(TM=128, TN=64, TK=64), dict(TM=64, TN=64, TK=64),
              dict(TM=64, TN=64, TK=32), dict(TM=64, TN=32, TK=64), dict(TM=32, TN=64, TK=64)]
PLAIN = dict(GROUP_M=8, SPLIT_K=1, PERSISTENT=0, occupancy=1, num_ctas=1, num_worker_warps=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.fp32_prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    import cupy
    import numpy as np
    import torch

    from benchmarks.harness.timing import measure, shared_stream
    from benchmarks.suites.model import build_hf, tilekit_state
    from tilekit.kernels.linear import LINEAR
    from tilekit.models.families import family_of_config, preset_config

    torch.backends.cuda.matmul.allow_tf32 = False
    config = preset_config("gpt2")
    hf = build_hf(config, "sdpa", dtype="float32", seed=0)
    model = family_of_config(config).model_class(config, dtype="float32", state=tilekit_state(hf, config))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq))
    ids_t = torch.from_numpy(ids).cuda()
    rows = []
    with shared_stream(), torch.no_grad():
        ref = hf(ids_t).logits.float().cpu().numpy()
        rows.append(("HF eager fp32", measure(lambda: hf(ids_t), flush_l2=False, warmup=2, reps=10)["median_ms"], 0.0))
        for name, pin in [("tilekit untuned default", None)] + [(f"tilekit linear {c['TM']}x{c['TN']}x{c['TK']}",
                                                                 dict(PLAIN, **c)) for c in CANDIDATES]:
            model.forget_graphs()
            if pin is None:
                out = model(ids)
                ms = measure(lambda: model(ids), flush_l2=False, warmup=2, reps=10)["median_ms"]
            else:
                with LINEAR.pinned(pin):
                    out = model(ids)
                    ms = measure(lambda: model(ids), flush_l2=False, warmup=2, reps=10)["median_ms"]
            got = cupy.asnumpy(out).astype(np.float64)
            rows.append((name, ms, float(np.linalg.norm(got - ref) / np.linalg.norm(ref))))
    print(f"gpt2 fp32 forward B{args.batch} T{args.seq} (full logits), H: HF eager; ratio = HF ms / tilekit ms")
    for name, ms, err in rows:
        print(f"{name:<34}{ms:9.3f} ms  {rows[0][1] / ms:6.2f}x  rel err {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

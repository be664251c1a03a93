"""One rank of the GPU tensor-parallel tests (test_tensor_parallel_gpu.py starts them with parallel.launch):

    python -m tests.models.tp_worker CHECKPOINT DTYPE OUT_DIR [die | int8 | fp8]

loads its shard of CHECKPOINT (of any family with tensor parallelism), and writes OUT_DIR/rank<R>.npz: forward()
logits with and without graphs, greedy tokens of generate() (32 new) with and without graphs, and sampled tokens,
seeded and not, and whether the small all-reduces went through peer memory. `int8` / `fp8`: the model quantized
at load (quantize=). `die`: rank 1 exits right after joining while rank 0 all-reduces until the watchdog stops it
(the test of a dead rank)."""

import faulthandler
import os
import sys
import time
from pathlib import Path

import numpy as np

from tilekit import parallel
from tilekit.models import families


def main(checkpoint: str, dtype: str, out: str, mode: str = "") -> None:
    import cupy
    # a rank stuck anywhere shows where, and exits
    faulthandler.dump_traceback_later(float(os.environ.get("TILEKIT_TEST_RANK_TIMEOUT", "240")), exit=True)
    comm = parallel.join(timeout=60)
    if mode == "die":
        if comm.rank == 1:
            os._exit(3)
        x = cupy.ones((1024,), cupy.float32)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:         # blocks once rank 1 is gone; the watchdog exits
            comm.all_reduce(x)
            cupy.cuda.get_current_stream().synchronize()
        return
    model = families.load_model(checkpoint, dtype=dtype, quantize=mode or None, comm=comm)
    ids = np.load(Path(checkpoint) / "input_ids.npy") if (Path(checkpoint) / "input_ids.npy").exists() else \
        np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 19))
    result = dict(
        graph=cupy.asnumpy(model(ids)).astype(np.float32), eager=cupy.asnumpy(model(ids, use_graph=False))
        .astype(np.float32),
        greedy=np.stack(model.generate(ids, 32, temperature=0, eos_token_id=[])),
        greedy_eager=np.stack(model.generate(ids, 32, temperature=0, eos_token_id=[], use_graph=False)),
        sampled=np.stack(model.generate(ids, 16, temperature=1.0, top_k=20, seed=5, eos_token_id=[])),
        unseeded=np.stack(model.generate(ids, 16, temperature=1.0, eos_token_id=[])),
        peer=np.array(comm is not None and comm.peers.usable))
    np.savez(Path(out) / f"rank{0 if comm is None else comm.rank}.npz", **result)
    if comm is not None:
        comm.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

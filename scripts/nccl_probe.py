"""Which NCCL path works on this host, for tilekit.parallel: CuPy's binding as it loads, or after preloading the
libnccl.so.2 of PyTorch's nvidia-nccl wheel; then one all-reduce over every GPU from this one process.

    source .gpu/setup.sh && python scripts/nccl_probe.py
"""

import os
import sys


def main() -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import cupy

    from tilekit import parallel
    print(f"cupy {cupy.__version__}; NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
    try:
        from cupy.cuda import nccl as direct
        print(f"direct import of cupy.cuda.nccl: ok (available={getattr(direct, 'available', '?')})")
    except ImportError as e:
        print(f"direct import of cupy.cuda.nccl: failed ({e})")
    try:
        nccl, how = parallel.load_nccl()
    except RuntimeError as e:
        print(f"no NCCL path works: {e}")
        return 1
    print(f"tilekit.parallel.load_nccl: {how}; NCCL version {nccl.get_version()}")
    count = cupy.cuda.runtime.getDeviceCount()
    print(f"{count} GPUs")
    if count < 2:
        return 0
    comms = nccl.NcclCommunicator.initAll(list(range(count)))
    arrays, streams = [], []
    for d in range(count):
        with cupy.cuda.Device(d):
            arrays.append(cupy.full((1 << 20,), d + 1, cupy.float32))
            streams.append(cupy.cuda.Stream(non_blocking=True))
    nccl.groupStart()
    for comm, x, s in zip(comms, arrays, streams):
        comm.allReduce(x.data.ptr, x.data.ptr, x.size, parallel.NCCL_DTYPES["float32"], parallel.NCCL_SUM, s.ptr)
    nccl.groupEnd()
    expected = count * (count + 1) / 2
    ok = True
    for d, (x, s) in enumerate(zip(arrays, streams)):
        with cupy.cuda.Device(d):
            s.synchronize()
            ok &= bool((x == expected).all())
    print(f"all-reduce over {count} GPUs in one process: {'ok' if ok else 'WRONG'} (expected {expected:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Who we run on: the GPU (name, compute capability, SM count) and the cuTile toolchain versions."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    """The identity of a GPU as far as tuning results are concerned."""

    name: str        # e.g. "NVIDIA H100 80GB HBM3"
    arch: str        # e.g. "sm_90"
    sm_count: int

    def as_dict(self) -> dict:
        return {"name": self.name, "arch": self.arch, "sm_count": self.sm_count}

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceInfo":
        return cls(name=str(d["name"]), arch=str(d["arch"]), sm_count=int(d["sm_count"]))


@functools.cache
def device_info(index: int | None = None) -> DeviceInfo:
    """Describe GPU `index` (default: CuPy's current device)."""
    import cupy
    if index is None:
        index = cupy.cuda.runtime.getDevice()
    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return DeviceInfo(name=name, arch=f"sm_{props['major']}{props['minor']}",
                      sm_count=int(props["multiProcessorCount"]))


def sm_count() -> int:
    """Streaming multiprocessors of CuPy's current GPU (sizes persistent grids)."""
    return device_info().sm_count


def gpu_unavailable_reason() -> str | None:
    """None when a CUDA GPU and driver are usable, else a one-line reason."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no libcuda, or CuPy missing
        return f"no CUDA GPU available ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if count == 0:
        return "no CUDA GPU available (device count is 0)"
    major = cupy.cuda.runtime.getDeviceProperties(0)["major"]
    if major < 8:
        return f"GPU compute capability {major}.x is below the sm_80 that cuTile needs"
    return None


@functools.cache
def toolchain() -> dict:
    """Versions that decide what the compiler emits: cuda-tile and tileiras."""
    import cuda.tile as ct
    tileiras = "unknown"
    try:
        from cuda.tile._compile import _get_compiler_version_string
        match = re.search(r"V(\d+\.\d+\.\d+)", _get_compiler_version_string() or "")
        if match:
            tileiras = match.group(1)
    except Exception:  # compiler not installed: tuning is impossible, lookups still work
        pass
    return {"cuda_tile": ct.__version__, "tileiras": tileiras}

"""What the numbers were measured on: GPU, clocks, driver, CUDA and library versions."""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import io
import platform
import shutil
import subprocess

SMI_FIELDS = "name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu,driver_version"


def parse_smi_csv(text: str) -> dict:
    """`nvidia-smi --query-gpu=... --format=csv` (header + one row) -> {field: value}."""
    rows = list(csv.reader(io.StringIO(text.strip())))
    if len(rows) < 2:
        return {}
    keys = [k.strip().split(" [")[0] for k in rows[0]]
    return {k: v.strip() for k, v in zip(keys, rows[1])}


def nvidia_smi(pci_bus_id: str | None = None) -> dict:
    """Name, clocks (MHz), power and driver of one GPU from nvidia-smi; {} when it is unavailable."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    cmd = [exe, f"--query-gpu={SMI_FIELDS}", "--format=csv"]
    if pci_bus_id:
        cmd += ["-i", pci_bus_id]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)}
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[:200]}
    return parse_smi_csv(out.stdout)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def gpu_identity() -> dict:
    """Name, arch, SM count, PCI bus id and the driver / runtime CUDA versions of the current GPU
    (through CuPy alone, so an older tilekit checkout can be described too)."""
    import cupy
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    info = {"name": name, "arch": f"sm_{props['major']}{props['minor']}",
            "sm_count": int(props["multiProcessorCount"]), "index": dev.id}
    info["pci_bus_id"] = dev.pci_bus_id
    info["l2_bytes"] = int(dev.attributes.get("L2CacheSize", 0))
    info["memory_bytes"] = int(cupy.cuda.runtime.memGetInfo()[1])
    info["cuda_driver"] = _cuda_version(cupy.cuda.runtime.driverGetVersion())
    info["cuda_runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
    return info


def versions() -> dict:
    v = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("torch", "transformers", "cupy-cuda13x", "cupy-cuda12x", "cupy", "numpy",
                 "cuda-tile", "matplotlib", "tilekit"):
        if (ver := _version(dist)) is not None:
            v[dist] = ver
    try:
        import torch
        v["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        from tilekit.device import toolchain
        v.update(toolchain())          # cuda_tile, tileiras
    except Exception as e:  # noqa: BLE001 - record, never fail the run over a version string
        v["toolchain_error"] = str(e)
    return v


def environment(mode: str, argv: list[str]) -> dict:
    """Everything results.json records about the run, clocks included (sampled now)."""
    from tilekit.autotune.op import autotune_mode
    gpu = gpu_identity()
    smi = nvidia_smi(gpu.get("pci_bus_id"))
    if smi.get("driver_version"):
        gpu["driver"] = smi["driver_version"]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": mode, "argv": list(argv), "gpu": gpu, "nvidia_smi_start": smi,
            "versions": versions(), "autotune_mode": autotune_mode()}

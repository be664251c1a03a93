"""tilekit: autotuned cuTile kernels (tilekit.kernels), models on them (tilekit.models), the engine that runs them
(tilekit.engine), and patch / unpatch, which run a Hugging Face model on them. Importing tilekit imports neither torch
nor the kernels."""

from importlib import metadata

try:
    __version__ = metadata.version("tilekit")
except metadata.PackageNotFoundError:   # a source tree that was never installed
    __version__ = "0+unknown"

import tilekit.engine  # noqa: F401,E402  (registers the runner every model's generate() calls into)

# Binding the functions here makes tilekit.patch the function, not the module of the same name.
from tilekit.patch import patch, unpatch

__all__ = ["__version__", "patch", "unpatch"]

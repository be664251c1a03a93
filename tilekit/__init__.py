"""tilekit: autotuned cuTile kernels (tilekit.kernels), models on them (tilekit.models), and patch / unpatch,
which run a Hugging Face GPT-2 or Llama on them. Importing tilekit imports neither torch nor the kernels."""

from importlib import metadata

try:
    __version__ = metadata.version("tilekit")
except metadata.PackageNotFoundError:   # a source tree that was never installed
    __version__ = "0+unknown"

# Binding the functions here makes tilekit.patch the function, not the module of the same name.
from tilekit.patch import patch, unpatch

__all__ = ["__version__", "patch", "unpatch"]

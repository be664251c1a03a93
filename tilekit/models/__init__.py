"""GPT-2 family models: tilekit's GPU model, its NumPy reference, configs and checkpoint I/O."""

from tilekit.models.config import PRESETS, GPTConfig
from tilekit.models.gpt import GPT
from tilekit.models.reference import ReferenceGPT

__all__ = ["GPT", "GPTConfig", "PRESETS", "ReferenceGPT"]

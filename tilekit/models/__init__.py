"""Models on tilekit's GPU kernels: GPT-2 and the Llama family, one folder each (config, weights, model,
reference); runtime.py is what the models share (CUDA graphs, KV cache, generation), hf.py the Hugging Face
checkpoint files."""

from tilekit.models.gpt2.config import PRESETS, GPTConfig
from tilekit.models.gpt2.model import GPT
from tilekit.models.gpt2.reference import ReferenceGPT
from tilekit.models.llama.config import PRESETS as LLAMA_PRESETS
from tilekit.models.llama.config import LlamaConfig
from tilekit.models.llama.model import Llama
from tilekit.models.llama.reference import ReferenceLlama

__all__ = ["GPT", "GPTConfig", "LLAMA_PRESETS", "Llama", "LlamaConfig", "PRESETS", "ReferenceGPT", "ReferenceLlama"]

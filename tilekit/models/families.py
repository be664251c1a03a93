"""The model families tilekit runs, one row each, keyed by Hugging Face's model_type: the only place that
chooses a family. The command line, tilekit.patch, the tuning workload and the benchmarks all ask here.

A family is one folder, tilekit/models/<family>/, with the same files in each: config.py (the config class,
PRESETS, from_fields / to_hf_dict), weights.py (Hugging Face tensor names <-> ours, loading, saving, random
weights, HUB_ORGS), model.py (the model on tilekit's kernels), reference.py (the NumPy
reference) and patch.py (tilekit.patch's rules for the family's transformers class). A row names the folder,
its classes and the transformers class tilekit.patch runs; the rest is read from the folder on first use, so
importing this module imports no GPU library (cupy, cuda.tile, torch).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from tilekit import checkpoints


@dataclass(frozen=True)
class Family:
    """One model family: its folder and what is in it."""

    model_type: str           # config.json's model_type
    package: str              # the folder, as a package
    config_name: str          # the config class in config.py
    model_name: str           # the model class in model.py
    reference_name: str       # the NumPy reference class in reference.py
    hf_module: str            # patch rules: the transformers modeling module
    hf_class: str             #   and its model class that tilekit.patch runs

    def module(self, name: str) -> ModuleType:
        """The family's module `name` (config, weights, model, reference or patch), imported on first use."""
        return importlib.import_module(f"{self.package}.{name}")

    @property
    def config_class(self) -> type:
        return getattr(self.module("config"), self.config_name)

    @property
    def model_class(self) -> type:
        return getattr(self.module("model"), self.model_name)

    @property
    def reference_class(self) -> type:
        return getattr(self.module("reference"), self.reference_name)

    @property
    def presets(self) -> dict:
        """Preset name -> the preset (config.py's PRESETS)."""
        return self.module("config").PRESETS

    def preset(self, name: str):
        """The config of one of this family's presets."""
        return self.config_class.preset(name)

    @property
    def weights(self) -> ModuleType:
        return self.module("weights")

    @property
    def patch(self) -> ModuleType:
        return self.module("patch")

    @property
    def hub_orgs(self) -> tuple[str, ...]:
        """Where a bare hub model name is also looked up ("gpt2" -> "openai-community/gpt2")."""
        return self.weights.HUB_ORGS

    def hf_model_class(self) -> type:
        """The transformers model class tilekit.patch runs (imports transformers)."""
        return getattr(importlib.import_module(self.hf_module), self.hf_class)


FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    Family("gpt2", "tilekit.models.gpt2", "GPTConfig", "GPT", "ReferenceGPT",
           "transformers.models.gpt2.modeling_gpt2", "GPT2LMHeadModel"),
    Family("llama", "tilekit.models.llama", "LlamaConfig", "Llama", "ReferenceLlama",
           "transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    Family("deepseek_v2", "tilekit.models.deepseek_v2", "DeepseekV2Config", "DeepseekV2", "ReferenceDeepseekV2",
           "transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2ForCausalLM"),
)}


def family_for_model_type(model_type: str) -> Family:
    """The family of a config.json's model_type; ValueError naming the families tilekit runs."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not a family tilekit runs ({', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def family_of_config(config) -> Family:
    """The family whose config class `config` is an instance of; TypeError for anything else."""
    for family in FAMILIES.values():
        if isinstance(config, family.config_class):
            return family
    names = " or ".join(family.config_name for family in FAMILIES.values())
    raise TypeError(f"config must be a {names}, got {type(config).__name__}")


def preset_names() -> list[str]:
    """Every family's preset names, family by family."""
    return [name for family in FAMILIES.values() for name in family.presets]


def preset_config(name: str):
    """The config of a preset of any family; ValueError naming every preset."""
    for family in FAMILIES.values():
        if name in family.presets:
            return family.preset(name)
    raise ValueError(f"unknown preset {name!r}; choose from {', '.join(preset_names())}")


def find_checkpoint(path_or_name) -> checkpoints.Checkpoint:
    """A checkpoint of any family: a directory, or a hub model name in the local cache, also looked up under every
    family's hub organisations."""
    return checkpoints.find_checkpoint(path_or_name, tuple(dict.fromkeys(org for family in FAMILIES.values()
                                                                 for org in family.hub_orgs)))


def family_of_fields(f: checkpoints.Fields) -> Family:
    """The family a config.json's model_type names; ModelFileError naming the file if it names none."""
    return FAMILIES[f.choice("model_type", tuple(FAMILIES))]


def config_from_path(path_or_name):
    """The config of a checkpoint (a directory or a hub model name in the local cache) or of a config.json file,
    of the family its model_type names."""
    if isinstance(path_or_name, (str, os.PathLike)) and str(path_or_name).endswith(".json"):
        f = checkpoints.read_config(path_or_name)
    else:
        f = find_checkpoint(path_or_name).config()
    return family_of_fields(f).config_class.from_fields(f)


def quantization_of(path_or_name, quantize: str | None = None, quantize_head: bool = False):
    """The quantization.Scheme of the model a checkpoint (a directory or a hub model name in the local cache) or a
    config.json loads as, for workload.model_problems: a checkpoint's own FP8 / INT8 scheme (block scales, its LM
    head as its file stores it) or `quantize` of a float one (CausalLM.loaded_scheme), a config.json's `quantize`
    (`quantize_head`: its LM head too); None: float linears."""
    from tilekit.models import quantization
    if isinstance(path_or_name, (str, os.PathLike)) and str(path_or_name).endswith(".json"):
        quantization.check_arguments(quantize, quantize_head)
        return quantize and quantization.Scheme(quantize, head=quantize_head)
    checkpoint = find_checkpoint(path_or_name)
    cls = family_of_fields(checkpoint.config()).model_class
    return cls.loaded_scheme(checkpoint, cls.config_class.from_fields(checkpoint.config()), quantize, quantize_head)


def load_model(path_or_name, dtype: str = "bfloat16", quantize: str | None = None, comm=None,
               quantize_head: bool = False):
    """The model of a checkpoint (a directory or a hub model name in the local cache), of the family its
    config.json's model_type names (that family's from_pretrained; `quantize`: "int8" or "fp8" linears,
    `quantize_head` the LM head too; `comm`: this rank's tilekit.parallel.Communicator, for a tensor-parallel
    rank's shard)."""
    checkpoint = find_checkpoint(path_or_name)
    options = {} if quantize is None else {"quantize": quantize}
    if quantize_head:
        options["quantize_head"] = True
    if comm is not None and comm.world_size > 1:
        options["comm"] = comm
    return family_of_fields(checkpoint.config()).model_class.from_pretrained(checkpoint, dtype=dtype, **options)


def load_reference(path_or_name, dtype=np.float32):
    """The NumPy reference model (the family's reference class, weights in `dtype`) of a checkpoint (a directory
    or a hub model name in the local cache): generation on the CPU, slow, for checking the GPU models."""
    checkpoint = find_checkpoint(path_or_name)
    return family_of_fields(checkpoint.config()).reference_class.from_pretrained(checkpoint, dtype=dtype)

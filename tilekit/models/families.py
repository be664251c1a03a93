"""The model families tilekit runs, one row each, keyed by Hugging Face's model_type: the only place that
chooses a family. The command line, tilekit.patch, the tuning workload and the benchmarks all ask here.

A family is one folder, tilekit/models/<family>/, with the same files in each: config.py (the config class,
PRESETS, from_hf_dict / to_hf_dict), weights.py (Hugging Face tensor names <-> ours, loading, saving, random
weights, WEIGHTS_FILES and HUB_ORGS), model.py (the model on tilekit's kernels), reference.py (the NumPy
reference) and patch.py (tilekit.patch's rules for the family's transformers class). A row names the folder,
its classes and the transformers class tilekit.patch runs; the rest is read from the folder on first use, so
importing this module imports no GPU library (cupy, cuda.tile, torch).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tilekit.models import hf


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

    @property
    def weights_files(self) -> tuple[str, ...]:
        """The weights files a checkpoint of this family may hold (one of them)."""
        return self.weights.WEIGHTS_FILES

    def hf_model_class(self) -> type:
        """The transformers model class tilekit.patch runs (imports transformers)."""
        return getattr(importlib.import_module(self.hf_module), self.hf_class)


FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    Family("gpt2", "tilekit.models.gpt2", "GPTConfig", "GPT", "ReferenceGPT",
           "transformers.models.gpt2.modeling_gpt2", "GPT2LMHeadModel"),
    Family("llama", "tilekit.models.llama", "LlamaConfig", "Llama", "ReferenceLlama",
           "transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
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


def checkpoint_dir(path_or_name: str | Path) -> Path:
    """The directory of a checkpoint of any family: a directory, or a hub model name in the local cache, also
    looked up under every family's hub organisations."""
    weights = tuple(dict.fromkeys(w for family in FAMILIES.values() for w in family.weights_files))
    orgs = tuple(dict.fromkeys(org for family in FAMILIES.values() for org in family.hub_orgs))
    return hf.resolve_checkpoint(path_or_name, weights, orgs)


def family_of_checkpoint(config_json: Path) -> tuple[Family, dict]:
    """(family, contents) of a config.json, chosen by its model_type; ValueError naming the file when the
    model_type is missing or not a family tilekit runs."""
    d = hf.read_json(config_json)
    if "model_type" not in d:
        raise ValueError(f"model config {config_json} has no model_type (tilekit runs {', '.join(FAMILIES)})")
    try:
        return family_for_model_type(d["model_type"]), d
    except ValueError as e:
        raise ValueError(f"model config {config_json}: {e}") from None


def config_from_path(path_or_name: str | Path):
    """The config of a checkpoint directory, a config.json file or a hub model name in the local cache, of the
    family its model_type names."""
    path = Path(path_or_name)
    if not (path.is_file() and path.name.endswith(".json")):
        path = checkpoint_dir(path_or_name) / hf.CONFIG_NAME
    family, d = family_of_checkpoint(path)
    return family.config_class.from_hf_dict(d)


def load_model(path_or_name: str | Path, dtype: str = "bfloat16"):
    """The model of a checkpoint directory or a hub model name in the local cache, of the family its
    config.json's model_type names (that family's from_pretrained)."""
    directory = checkpoint_dir(path_or_name)
    family, _ = family_of_checkpoint(directory / hf.CONFIG_NAME)
    return family.model_class.from_pretrained(directory, dtype=dtype)

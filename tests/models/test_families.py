"""The families table: every row points at a complete folder, lookups by model_type, config and preset, and
checkpoints dispatched by their config.json's model_type (a missing or unknown one refused, naming the file)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tilekit.models import families
from tilekit.models.families import FAMILIES
from tilekit.models.base import CausalLM

DATA = Path(__file__).resolve().parents[1] / "data"


def test_importing_the_table_imports_no_gpu_library():
    probe = ("import sys, tilekit.models.families as f; f.FAMILIES['gpt2'].presets; "
             "print(sorted(m for m in ('cupy', 'cuda.tile', 'torch', 'tilekit.kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_row_points_at_a_complete_folder(model_type):
    family = FAMILIES[model_type]
    assert family.model_type == model_type and family.package == f"tilekit.models.{model_type}"   # the folder
    config = family.preset(next(iter(family.presets)))
    assert isinstance(config, family.config_class)
    hf = config.to_hf_dict()
    assert hf["model_type"] == model_type and hf["architectures"] == [family.hf_class]
    assert family.hf_module == f"transformers.models.{model_type}.modeling_{model_type}"
    assert issubclass(family.model_class, CausalLM)
    assert family.reference_class.weights is family.weights
    for name in ("state_dict_shapes", "block_shapes", "check_state_dict", "load", "load_state_dict",
                 "save_state_dict", "random_state_dict", "weight_stats", "resolve", "PREFIX", "EMBEDDING",
                 "BUFFER_SUFFIXES"):
        assert hasattr(family.weights, name), name
    assert family.hub_orgs
    assert family.model_class.weights is family.weights and family.model_class.config_class is family.config_class
    for name in ("head_dim", "config_problems", "mlp", "forwards"):
        assert callable(getattr(family.patch, name)), name


def test_lookups():
    from tilekit.models import DEEPSEEK_V2_PRESETS, LLAMA_PRESETS, PRESETS, GPTConfig, LlamaConfig
    assert families.family_for_model_type("llama") is FAMILIES["llama"]
    with pytest.raises(ValueError, match="'mistral' is not a family tilekit runs \\(gpt2, llama, deepseek_v2\\)"):
        families.family_for_model_type("mistral")
    assert families.family_of_config(GPTConfig()) is FAMILIES["gpt2"]
    assert families.family_of_config(LLAMA_PRESETS["llama-3.1-8b"]) is FAMILIES["llama"]
    with pytest.raises(TypeError, match="GPTConfig or LlamaConfig or DeepseekV2Config, got dict"):
        families.family_of_config({})
    assert families.preset_names() == [*PRESETS, *LLAMA_PRESETS, *DEEPSEEK_V2_PRESETS]
    assert families.preset_config("gpt2-xl") == GPTConfig.preset("gpt2-xl")
    assert families.preset_config("tinyllama-1.1b") == LlamaConfig.preset("tinyllama-1.1b")
    with pytest.raises(ValueError, match="unknown preset 'gpt5'; choose from gpt2, gpt2-medium"):
        families.preset_config("gpt5")


def test_config_from_path_reads_the_model_type(tmp_path):
    from tilekit.models import GPTConfig, LlamaConfig
    assert isinstance(families.config_from_path(DATA / "tiny-gpt2"), GPTConfig)
    assert isinstance(families.config_from_path(DATA / "tiny-llama"), LlamaConfig)       # sharded
    assert families.config_from_path(DATA / "tiny-llama-tied" / "config.json").tie_word_embeddings
    d = json.loads((DATA / "tiny-gpt2" / "config.json").read_text())
    expected = 'expected one of "gpt2", "llama", "deepseek_v2"'
    for model_type, problem in ((None, f"is missing, {expected}"), ("mistral", f'is "mistral", {expected}'),
                                (7, f"is 7, {expected}"), ("gpt_bigcode", f'is "gpt_bigcode", {expected}')):
        path = tmp_path / f"{model_type}.json"
        path.write_text(json.dumps({k: v for k, v in d.items() if k != "model_type"}
                                   | ({} if model_type is None else {"model_type": model_type})))
        with pytest.raises(ValueError) as info:
            families.config_from_path(path)
        assert str(info.value) == f"{path}: field 'model_type' {problem}"
    (tmp_path / "ck").mkdir()
    path.rename(tmp_path / "ck" / "config.json")
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"")   # never read: the config is refused first
    with pytest.raises(ValueError, match=f"ck/config.json: field 'model_type' is \"gpt_bigcode\""):
        families.config_from_path(tmp_path / "ck")


def test_load_model_is_the_family_from_pretrained(monkeypatch):
    from tilekit.models import GPT, Llama
    calls = []
    for cls in (GPT, Llama):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda c, d, dtype: calls.append((c, d, dtype))))
    families.load_model(DATA / "tiny-llama", dtype="float32")
    families.load_model(DATA / "tiny-gpt2")
    assert [(c, d.directory, dtype) for c, d, dtype in calls] == [(Llama, DATA / "tiny-llama", "float32"),
                                                                  (GPT, DATA / "tiny-gpt2", "bfloat16")]
    with pytest.raises(FileNotFoundError, match=f"^{DATA}/config.json: no such file$"):
        families.load_model(DATA)

"""Hugging Face GPT-2 checkpoints: find them on disk, load and validate them, save them, make random ones;
and the checkpoint helpers every model family shares (llama_checkpoint.py uses them too).

A checkpoint is a directory holding config.json and model.safetensors, as GPT2LMHeadModel.save_pretrained
writes it or as the Hugging Face hub cache stores it. Tensor names here are GPT2Model's ("h.0.ln_1.weight"),
weights are laid out [in, out] like GPT-2's Conv1D, and the LM head is tied to wte.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from tilekit.models.config import GPTConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PREFIX = "transformer."  # what GPT2LMHeadModel puts before GPT2Model's names
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers that old checkpoints carry
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # importing ml_dtypes also lets safetensors.numpy read BF16 tensors


# -- helpers shared by the model families -----------------------------------------------------------------

def float_dtype(dtype) -> np.dtype:
    """`dtype` as a NumPy dtype, which must be float32 or float64: what checkpoints load as."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


def check_tensors(expected: dict[str, tuple[int, ...]], state: dict, heading: str) -> None:
    """Raise ValueError, `heading` first, listing every missing, unexpected, misshapen or non-float tensor."""
    problems = []
    for name, array in state.items():
        if name not in expected:
            problems.append(f"unexpected tensor {name!r}")
        elif not isinstance(array, np.ndarray) or not (np.issubdtype(array.dtype, np.floating)
                                                       or array.dtype == BFLOAT16):
            problems.append(f"tensor {name!r} must be a floating-point numpy array, "
                            f"got {getattr(array, 'dtype', type(array).__name__)}")
        elif array.shape != expected[name]:
            problems.append(f"tensor {name!r} has shape {array.shape}, expected {expected[name]}")
    # Missing names go last: a wrong prefix or size shows in the first lines.
    problems += [f"missing tensor {name!r} (shape {shape})" for name, shape in expected.items() if name not in state]
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"{heading}:\n  {shown}")


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (BF16 ones as ml_dtypes.bfloat16); ValueError naming a bad file."""
    try:
        return safetensors.numpy.load_file(path)
    except (safetensors.SafetensorError, OSError, TypeError) as e:  # TypeError: a dtype NumPy does not know
        raise ValueError(f"cannot read safetensors file {path}: {e}") from None


def write_checkpoint(directory: str | Path, hf_config: dict, tensors: dict[str, np.ndarray]) -> None:
    """Write config.json and a float32 model.safetensors, as Hugging Face save_pretrained does."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in tensors.items()}
    # transformers refuses safetensors files whose metadata lacks the framework it was saved from.
    safetensors.numpy.save_file(tensors, directory / WEIGHTS_NAME, metadata={"format": "pt"})


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int, dtype, stats) -> dict[str, np.ndarray]:
    """N(mean, std) tensors of `shapes`, drawn in order from one generator seeded with `seed`;
    stats(name) -> (mean, std)."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in shapes.items():
        mean, std = stats(name)
        state[name] = (mean + std * rng.standard_normal(shape)).astype(dtype)
    return state


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, located the way huggingface_hub locates it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface" / "hub"


def resolve_checkpoint(path_or_name: str | Path, weights: tuple[str, ...] = (WEIGHTS_NAME,),
                       orgs: tuple[str, ...] = ("openai-community",)) -> Path:
    """Directory of a checkpoint (config.json and one of `weights`): `path_or_name` itself, or a hub model
    name found in the local cache. Never touches the network. A bare name like "gpt2" is also looked up under
    each of `orgs` ("openai-community/gpt2").
    """
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        missing = _lacks(path, weights)
        if missing:
            raise FileNotFoundError(f"checkpoint directory {path} lacks {', '.join(missing)}")
        return path
    searched = [str(path)]
    name = str(path_or_name)
    if _HUB_NAME.fullmatch(name):
        for repo_id in [name] + ([f"{org}/{name}" for org in orgs] if "/" not in name else []):
            repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
            snapshot = _cached_snapshot(repo, weights)
            if snapshot is not None:
                return snapshot
            searched.append(str(repo / "snapshots"))
    raise FileNotFoundError(f"no checkpoint ({CONFIG_NAME} + {' or '.join(weights)}) for {name!r}; searched: "
                            + ", ".join(searched))


def _lacks(directory: Path, weights: tuple[str, ...]) -> list[str]:
    """What `directory` lacks of a checkpoint: config.json, one of `weights`."""
    missing = [] if (directory / CONFIG_NAME).is_file() else [CONFIG_NAME]
    return missing + ([] if any((directory / w).is_file() for w in weights) else [" or ".join(weights)])


def _cached_snapshot(repo: Path, weights: tuple[str, ...]) -> Path | None:
    """The hub-cache snapshot of `repo` that is complete: refs/main's revision first, then the newest."""
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidates.insert(0, snapshots / ref.read_text().strip())
    for snapshot in candidates:
        if not _lacks(snapshot, weights):
            return snapshot
    return None


def pop_tied_lm_head(state: dict, embedding: str, source: str) -> None:
    """Drop the lm_head.weight some checkpoints of a tied model carry; ValueError if it differs from `embedding`."""
    lm_head = state.pop("lm_head.weight", None)
    if lm_head is not None and embedding in state and not np.array_equal(lm_head, state[embedding]):
        raise ValueError(f"tensor 'lm_head.weight' in {source} differs from {embedding!r}, "
                         "to which this model ties its LM head")


# -- GPT-2 ------------------------------------------------------------------------------------------------


def state_dict_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a GPT-2 of this config has (the tied LM head excluded)."""
    C, V, P = config.n_embd, config.vocab_size, config.block_size
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C)}
    for i in range(config.n_layer):
        shapes.update({
            f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
            f"h.{i}.attn.c_attn.weight": (C, 3 * C), f"h.{i}.attn.c_attn.bias": (3 * C,),
            f"h.{i}.attn.c_proj.weight": (C, C), f"h.{i}.attn.c_proj.bias": (C,),
            f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
            f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
            f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,),
        })
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return shapes


def check_state_dict(config: GPTConfig, state: dict, source: str = "state dict") -> None:
    """Raise ValueError listing every missing, unexpected, misshapen or non-float tensor of `source`."""
    check_tensors(state_dict_shapes(config), state, f"{source} does not match {config}")


def load_state_dict(path_or_name: str | Path, dtype=np.float32) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """Config and validated tensors (canonical names, C-contiguous, `dtype`) of a GPT-2 checkpoint."""
    dtype = float_dtype(dtype)
    directory = resolve_checkpoint(path_or_name)
    config = GPTConfig.from_json(directory / CONFIG_NAME)
    weights_file = directory / WEIGHTS_NAME
    state = {}
    for name, array in read_safetensors(weights_file).items():
        key = name.removeprefix(PREFIX)
        if key.endswith(BUFFER_SUFFIXES):
            continue
        if key in state:
            raise ValueError(f"tensor {key!r} appears twice (with and without {PREFIX!r}) in {weights_file}")
        state[key] = array
    pop_tied_lm_head(state, "wte.weight", str(weights_file))
    check_state_dict(config, state, source=str(weights_file))
    return config, {name: np.ascontiguousarray(state[name], dtype=dtype) for name in state_dict_shapes(config)}


def save_state_dict(directory: str | Path, config: GPTConfig, state: dict[str, np.ndarray]) -> None:
    """Write config.json and a float32 model.safetensors that GPT2LMHeadModel.from_pretrained reads."""
    check_state_dict(config, state)
    write_checkpoint(directory, config.to_hf_dict(), {PREFIX + name: array for name, array in state.items()})


def random_state_dict(config: GPTConfig, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """GPT-2 style random weights, deterministic for `seed`.

    Linear and embedding weights ~ N(0, 0.02), the residual projections (c_proj) scaled by 1/sqrt(2 n_layer)
    as in GPT-2. Biases and LayerNorm parameters are random too, not 0 and 1, so tests exercise them.
    """
    def stats(name: str) -> tuple[float, float]:
        if ".ln_" in name or name.startswith("ln_f."):
            return (1.0 if name.endswith(".weight") else 0.0), 0.1
        if name.endswith("c_proj.weight"):
            return 0.0, 0.02 / math.sqrt(2 * config.n_layer)
        return 0.0, 0.02
    return random_tensors(state_dict_shapes(config), seed, dtype, stats)

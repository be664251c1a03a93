"""Hugging Face Llama checkpoints: load and validate them (single-file or sharded), save them, make random ones.

A checkpoint is a directory with config.json and either model.safetensors or model.safetensors.index.json and
the shards it names, as LlamaForCausalLM.save_pretrained writes it or the hub cache stores it. Tensor names are
LlamaForCausalLM's ("model.layers.0.self_attn.q_proj.weight"), weights are nn.Linear's [out, in], and
lm_head.weight exists unless the config ties it to model.embed_tokens.weight. Every file is untrusted input.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from tilekit.models.checkpoint import (CONFIG_NAME, WEIGHTS_NAME, check_tensors, float_dtype, pop_tied_lm_head,
                                       random_tensors, read_safetensors, resolve_checkpoint, write_checkpoint)
from tilekit.models.config import read_json
from tilekit.models.llama_config import LlamaConfig

INDEX_NAME = "model.safetensors.index.json"
EMBEDDING = "model.embed_tokens.weight"
BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer that checkpoints of older transformers carry


def state_dict_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a Llama of this config has (lm_head only when untied)."""
    C, V, I = config.n_embd, config.vocab_size, config.intermediate_size
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    shapes = {EMBEDDING: (V, C)}
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (C,),
            p + "self_attn.q_proj.weight": (q, C), p + "self_attn.k_proj.weight": (kv, C),
            p + "self_attn.v_proj.weight": (kv, C), p + "self_attn.o_proj.weight": (C, q),
            p + "post_attention_layernorm.weight": (C,),
            p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C), p + "mlp.down_proj.weight": (C, I),
        })
    shapes["model.norm.weight"] = (C,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def check_state_dict(config: LlamaConfig, state: dict, source: str = "state dict") -> None:
    """Raise ValueError listing every missing, unexpected, misshapen or non-float tensor of `source`."""
    check_tensors(state_dict_shapes(config), state, f"{source} does not match {config}")


def shard_files(index: Path) -> dict[Path, set[str]]:
    """The shards a safetensors index names, each with the tensor names the index maps to it.

    The index is untrusted: each shard must be a plain file name of a regular file in the index's directory (in
    a hub cache snapshot, a link into the repository's blobs), and no two names may be the same file.
    """
    weight_map = read_json(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(shard, str) for shard in weight_map.values()):
        raise ValueError(f"safetensors index {index}: 'weight_map' must be a non-empty object of tensor name -> "
                         "shard file name")
    directory = index.parent
    # huggingface_hub links a snapshot's files to ../../blobs/: the repository folder is what they must stay in.
    root = directory.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        root = root.parent.parent
    files, seen = {}, {}
    for shard in sorted(set(weight_map.values())):
        real = _shard_file(directory, root, shard)
        if real is None:
            raise ValueError(f"safetensors index {index} names shard {shard!r}, which is not a file in {directory}")
        if real in seen:
            raise ValueError(f"safetensors index {index} names one file twice: {seen[real]!r} and {shard!r}")
        seen[real] = shard
        files[directory / shard] = {name for name, s in weight_map.items() if s == shard}
    return files


def _shard_file(directory: Path, root: Path, shard: str) -> Path | None:
    """The real path of `shard`, or None unless it is a plain file name of a regular file that stays in `root`."""
    if shard in ("", ".", "..") or any(c in shard for c in "/\\\0"):
        return None
    try:
        real = (directory / shard).resolve()
        return real if real.is_relative_to(root) and real.is_file() else None
    except (OSError, RuntimeError):  # a name too long; a link loop (RuntimeError before Python 3.13)
        return None


def load_state_dict(path_or_name: str | Path, dtype=np.float32) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Config and validated tensors (canonical names, C-contiguous, `dtype`) of a Llama checkpoint.

    `path_or_name` is a directory or a hub model name in the local cache ("Llama-3.2-1B" is also looked up as
    "meta-llama/Llama-3.2-1B"). BF16, FP16 and FP32 tensors load. As in transformers, model.safetensors wins
    over an index; with an index, every tensor must sit in the one shard the index maps it to.
    """
    dtype = float_dtype(dtype)
    directory = resolve_checkpoint(path_or_name, weights=(WEIGHTS_NAME, INDEX_NAME), orgs=("meta-llama",))
    config = LlamaConfig.from_json(directory / CONFIG_NAME)
    source = directory / WEIGHTS_NAME
    if source.is_file():
        files = {source: None}
    else:
        source = directory / INDEX_NAME
        files = shard_files(source)
    state = {}
    for path, listed in files.items():
        tensors = read_safetensors(path)
        if listed is not None and tensors.keys() != listed:
            problems = [f"{what} {names[:5]}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                        for what, names in (("holds tensors the index maps elsewhere or not at all",
                                             sorted(tensors.keys() - listed)),
                                            ("lacks tensors the index maps to it", sorted(listed - tensors.keys())))
                        if names]
            raise ValueError(f"shard {path} does not match {source}: it {'; it '.join(problems)}")
        state.update((name, a) for name, a in tensors.items() if not name.endswith(BUFFER_SUFFIXES))
    if config.tie_word_embeddings:
        pop_tied_lm_head(state, EMBEDDING, str(source))
    check_state_dict(config, state, source=str(source))
    return config, {name: np.ascontiguousarray(state[name], dtype=dtype) for name in state_dict_shapes(config)}


def save_state_dict(directory: str | Path, config: LlamaConfig, state: dict[str, np.ndarray]) -> None:
    """Write config.json and a float32 model.safetensors that LlamaForCausalLM.from_pretrained reads."""
    check_state_dict(config, state)
    write_checkpoint(directory, config.to_hf_dict(), state)


def random_state_dict(config: LlamaConfig, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Llama-style random weights, deterministic for `seed`.

    Projections and embeddings ~ N(0, 0.02), the residual ones (o_proj, down_proj) scaled by 1/sqrt(2 n_layer).
    RMSNorm weights ~ N(1, 0.1), not all ones, so tests exercise them.
    """
    return random_tensors(state_dict_shapes(config), seed, dtype, lambda name: weight_stats(config, name))


def weight_stats(config: LlamaConfig, name: str) -> tuple[float, float]:
    """(mean, standard deviation) of random weights for tensor `name` (see random_state_dict)."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, 0.02 / math.sqrt(2 * config.n_layer)
    return 0.0, 0.02

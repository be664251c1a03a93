"""CheckpointLayout: how one family's weights sit in Hugging Face checkpoints, and what is done with them (load,
load to the host, save, check, draw at random)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from tilekit.checkpoints.checkpoint import Checkpoint, find_checkpoint
from tilekit.checkpoints.load import check_arrays, float_dtype, load_weights
from tilekit.checkpoints.stream import HostDevice
from tilekit.checkpoints.write import random_tensors, write_checkpoint


@dataclass(frozen=True)
class CheckpointLayout:
    """How one family's weights sit in Hugging Face checkpoints, and what is done with them. `shapes(config)`:
    our name -> shape of every tensor (a tied LM head excluded); `stats(config, name)`: (mean, std) of random
    weights; `prefix`: what the file may put before our names; `embedding`: the tensor a tied LM head is;
    `buffers`: name suffixes of buffers old checkpoints carry; `hub_orgs`: where a bare hub name is also looked
    up; `stored(config, names in a file, parts)`: the file's tensors kept in another form than ours (load_weights; a
    tensor-parallel rank's `parts` of ours, {} for a whole model, say which slices of them to read) and
    `to_file(config, state)`: ours in the file's form (what save writes), where a family's layout differs from the
    file's. A family's weights module exposes these methods as its functions."""

    config_class: type
    shapes: Callable[..., dict]
    stats: Callable[..., tuple[float, float]]
    embedding: str
    prefix: str = ""
    buffers: tuple[str, ...] = ()
    hub_orgs: tuple[str, ...] = ()
    stored: Callable | None = None
    to_file: Callable | None = None

    def resolve(self, path_or_name) -> Checkpoint:
        """A checkpoint: a directory, or a hub model name in the local cache (a bare name also under hub_orgs)."""
        return find_checkpoint(path_or_name, self.hub_orgs)

    def load(self, checkpoint: Checkpoint, config, *, dtype: str, outs=None, device=None, rewrite=None,
             ignore: tuple[str, ...] = (), parts: Mapping | None = None) -> dict:
        """The checkpoint's weights as arrays of `dtype` under our names (load_weights: `outs`, `device`,
        `rewrite`, `parts`); a tied model's lm_head.weight, if the file has one, checked and dropped. BF16, FP16
        and FP32 tensors load, from one file or from shards; names ending in one of `ignore` are read past."""
        return load_weights(checkpoint, self.shapes(config), dtype=dtype, outs=outs, device=device,
                            prefix=self.prefix, tied=self.embedding if config.tie_word_embeddings else None,
                            ignore=self.buffers + ignore, expected=str(config), rewrite=rewrite, parts=parts,
                            stored=self.stored and (lambda names: self.stored(config, names, parts or {})))

    def load_state_dict(self, path_or_name, dtype=np.float32) -> tuple:
        """(config, host tensors: our names, C-contiguous, float32 or float64) of a checkpoint."""
        checkpoint = self.resolve(path_or_name)
        config = self.config_class.from_fields(checkpoint.config())
        return config, self.load(checkpoint, config, dtype=float_dtype(dtype).name, device=HostDevice())

    def save_state_dict(self, directory, config, state: Mapping, dtype: str = "float32",
                        shard_bytes: int | None = None) -> None:
        """Write config.json and the weights (in `dtype`, from host or device arrays; model.safetensors, or shards
        of at most `shard_bytes` and their index) as the family's transformers class's save_pretrained does."""
        self.check_state_dict(config, state)
        if self.to_file is not None:
            state = self.to_file(config, state)
        write_checkpoint(directory, dict(config.to_hf_dict(), torch_dtype=dtype),
                         {self.prefix + name: array for name, array in state.items()}, dtype=dtype,
                         shard_bytes=shard_bytes)

    def check_state_dict(self, config, state: Mapping) -> None:
        """ValueError listing every missing, unexpected, misshapen or non-float array of `state`."""
        check_arrays(self.shapes(config), state, f"state dict does not match {config}")

    def random_state_dict(self, config, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
        """Random host weights as `stats` scales them, deterministic for `seed`."""
        return random_tensors(self.shapes(config), seed, dtype, lambda name: self.stats(config, name))

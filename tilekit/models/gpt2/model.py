"""GPT-2 on tilekit's cuTile kernels: the weights and the math; tilekit.engine runs it.

Every op of the forward pass is a tilekit kernel dispatched with the config the tuning database
holds for this GPU and shape; CuPy only allocates memory and moves data. Names follow the Hugging
Face checkpoint (wte, wpe, h.i.ln_1, attn.c_attn, ...), weights stay [in, out] as stored, and the
LM head reads wte in place.

With few rows (a decode step) the residual stream is fixed point (kernels/tiles.py): the
attention and MLP output projections add into it in place, their K split over many programs. With
many rows it is an array of the model's dtype and each of them writes the sum into the other of two
buffers.

Tensor-parallel (`comm=`; weights.shard_parts): a rank runs its share of the heads and of the MLP's columns; each
output projection's partial product is summed by one all-reduce (two per layer), the bias and the residual counted
once: in fixed point the other ranks zero their copy of the stream before adding their partial into it (the
integer sum is exact, in any order), in the model's dtype only rank 0 adds the residual and the bias. The LM head
is a row view of wte per rank (CausalLM.vocab_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tilekit import parallel
from tilekit.kernels import embedding, layer_norm, linear, residual_linear
from tilekit.kernels.tiles import FIXED_DTYPE
from tilekit.models.gpt2 import weights
from tilekit.models.gpt2.config import GPTConfig
from tilekit.models.base import DTYPES, Arrays, CausalLM


# A block's tensors under their Hugging Face names, in Block's field order.
BLOCK_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                "mlp.c_proj.weight", "mlp.c_proj.bias")


@dataclass
class Block:
    """One transformer block's parameters (device arrays), in BLOCK_PARAMS order."""

    ln_1_w: object
    ln_1_b: object
    attn_w: object
    attn_b: object
    proj_w: object
    proj_b: object
    ln_2_w: object
    ln_2_b: object
    fc_w: object
    fc_b: object
    mlp_proj_w: object
    mlp_proj_b: object


class Activations:
    """The blocks' working buffers for B sequences of T tokens as (B*T, width) rows, allocated once so
    that a pass over the blocks allocates nothing and can be captured as a CUDA graph; q, k, v and
    heads are the (B, H, T, D) views attention reads and writes. x is the residual stream: fixed point
    for up to `fixed_rows` rows, else the model's dtype with `other` as the second buffer."""

    def __init__(self, config: GPTConfig, batch: int, tokens: int, dtype: str, arrays: Arrays, fixed_rows: int,
                 ranks: int = 1):
        """ranks: the tensor-parallel size (this rank's heads and MLP columns are 1 / ranks of the config's)."""
        M, C, D = batch * tokens, config.n_embd, config.head_dim
        H = config.n_head // ranks
        self.fixed = M <= fixed_rows
        self.x = arrays.empty((M, C), FIXED_DTYPE if self.fixed else dtype)
        self.other = None if self.fixed else arrays.empty((M, C), dtype)
        self.h = arrays.empty((M, C), dtype)
        self.y = arrays.empty((M, H * D), dtype)
        self.qkv = arrays.empty((M, 3 * H * D), dtype)
        self.f = arrays.empty((M, 4 * C // ranks), dtype)
        self.q, self.k, self.v = (self.qkv.reshape(batch, tokens, 3, H, D)[:, :, j].transpose(0, 2, 1, 3)
                                  for j in range(3))
        self.heads = self.y.reshape(batch, tokens, H, D).transpose(0, 2, 1, 3)


class GPT(CausalLM):
    """A GPT-2 family model whose forward pass runs entirely on tilekit kernels."""

    weights = weights
    config_class = GPTConfig
    fixed_point_rows = 16   # passes of up to this many rows keep a fixed-point residual stream

    def __init__(self, config: GPTConfig, *, dtype: str = "bfloat16", seed: int = 0,
                 state: dict[str, np.ndarray] | None = None, empty: bool = False, allow_tf32: bool = False,
                 meta: bool = False, comm: parallel.Communicator | None = None):
        """Random GPT-2 initialisation drawn on the GPU from `seed`, or the given state dict (Hugging Face names,
        any float dtype), or uninitialised weights (empty=True: from_pretrained streams them in).
        meta=True: MetaArray weights (no GPU, no memory), for tracing the kernels the model runs. comm: this rank's
        Communicator of a tensor-parallel group (weights from `state` or a checkpoint, sliced to its shard)."""
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if allow_tf32 and dtype != "float32":
            raise ValueError("allow_tf32 applies to dtype='float32' only")
        self.config, self.dtype, self.allow_tf32, self.meta = config, dtype, allow_tf32, meta
        self._init_comm(comm, state is not None or empty or meta)
        self.ranks = 1 if self.comm is None else self.comm.world_size
        new = Arrays(meta).empty
        self.params = w = {name: new(parallel.part_shape(shape, self.parts[name]) if name in self.parts else shape, dtype)
                           for name, shape in weights.state_dict_shapes(config).items()}
        self._init_weights(state, seed, empty)
        self.wte, self.wpe = w["wte.weight"], w["wpe.weight"]
        self.head = self.head_weight(self.wte)
        self.ln_f_w, self.ln_f_b = w["ln_f.weight"], w["ln_f.bias"]
        self.blocks = [Block(*(w[f"h.{i}.{n}"] for n in BLOCK_PARAMS)) for i in range(config.n_layer)]

    # -- the math ---------------------------------------------------------------------------------
    def meta_twin(self) -> "GPT":
        """This model with MetaArray weights: what a dry run of its kernels needs."""
        return GPT(self.config, dtype=self.dtype, allow_tf32=self.allow_tf32, meta=True, comm=self.shape_only_comm())

    def activations(self, batch: int, tokens: int, arrays: Arrays) -> Activations:
        return Activations(self.config, batch, tokens, self.dtype, arrays, self.fixed_point_rows, self.ranks)

    def cache_dims(self) -> tuple[int, int, int]:
        """(layers, key/value heads, head_dim) of the KV cache."""
        return self.config.n_layer, self.config.n_head // self.ranks, self.config.head_dim

    def hidden(self, acts: Activations, ids, positions, attend):
        """Token plus position embeddings through every block; returns the residual stream (B*T, C).

        attend(layer, q, k, v, out) writes one layer's attention into out (B, H, T, D) and fills the
        KV cache where there is one."""
        eps = self.config.layer_norm_epsilon
        embedding(ids, self.wte, self.wpe, positions, out=acts.x)
        for i, blk in enumerate(self.blocks):
            layer_norm(acts.x, blk.ln_1_w, blk.ln_1_b, eps, out=acts.h)
            self._linear(acts.h, blk.attn_w, blk.attn_b, out=acts.qkv)
            attend(i, acts.q, acts.k, acts.v, acts.heads)
            self._add_linear(acts, acts.y, blk.proj_w, blk.proj_b)
            layer_norm(acts.x, blk.ln_2_w, blk.ln_2_b, eps, out=acts.h)
            self._linear(acts.h, blk.fc_w, blk.fc_b, activation="gelu", out=acts.f)
            self._add_linear(acts, acts.f, blk.mlp_proj_w, blk.mlp_proj_b)
        return acts.x

    def final_norm(self, x, out, rows=None) -> None:
        """ln_f of x (of the rows `rows` only, when given) into out."""
        layer_norm(x, self.ln_f_w, self.ln_f_b, self.config.layer_norm_epsilon, rows=rows, out=out)

    def head_product(self, h, out):
        """The LM head, tied to the token embedding, through _linear (allow_tf32)."""
        return self._linear(h, self.head, weight_layout="out_in", out=out)

    def _linear(self, x, w, b=None, **kw):
        return linear(x, w, b, allow_tf32=self.allow_tf32, **kw)

    def _add_linear(self, acts: Activations, a, w, b) -> None:
        """The residual stream acts.x += a @ w + b: in place when fixed point, else into acts.other,
        which then becomes acts.x. Tensor-parallel: a is this rank's share of the input rows of w; the partial
        sums are all-reduced, the residual and the bias counted once (see the module doc)."""
        lead = self.comm is None or self.comm.rank == 0
        if acts.fixed:
            self.add_partial(acts.x, lambda: residual_linear(acts.x, a, w, b if lead else None))
        else:
            self._linear(a, w, b if lead else None, residual=acts.x if lead else None, out=acts.other)
            self.sum_ranks(acts.other)
            acts.x, acts.other = acts.other, acts.x

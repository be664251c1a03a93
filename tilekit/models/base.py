"""What every model on tilekit's kernels shares: its weights and the plumbing of its math, apart from what runs it.

A model class (GPT, Llama, DeepseekV2) holds weights and writes its math as methods: `activations` (its working
buffers), `hidden` (embeddings and blocks, attending through a cache it is handed), `final_norm`, `lm_head`, and
`cache_spec` (the cache its attention keeps: per-head keys and values, or DeepSeek-V2's latents). `CausalLM` adds
what they share: the quantized-linear plumbing (quantization.Scheme, project), the tensor-parallel glue of the math
(vocabulary-parallel LM head, partial sums over the ranks), the attend functions over a cache's interface, weights
from a seed, a state dict or a checkpoint (tilekit.checkpoints), and saving. Running it (forward, generate, CUDA
graphs, the KV cache's memory, sampling, the tuning workload) is tilekit.engine's: model.generate() and the rest are
thin calls into the runner the engine makes for the model (models/running.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType
from typing import Callable, Sequence

import numpy as np

from tilekit import parallel
from tilekit.autotune.arrays import MetaArray, numpy_dtype
from tilekit.checkpoints import CONFIG_NAME, LM_HEAD, ModelFileError, convert, write_checkpoint
from tilekit.kernels import attention, linear, quant_linear, quantize_fp8, rms_norm
from tilekit.kernels.quant_linear import QBLOCK, WEIGHT_DTYPES, dequantize_reference
from tilekit.models import quantization
from tilekit.models.running import LanguageModel
from tilekit.untrusted import quoted

W8A8_MIN_ROWS = 128    # FP8 weights: from this many rows (prefill) the activations go to FP8 too
DTYPES = ("bfloat16", "float16", "float32")       # a model's weights and activations


class Arrays:
    """Where a model's buffers live: CuPy arrays on the current GPU, or MetaArrays (a dry run)."""

    def __init__(self, meta: bool = False):
        self.meta = meta

    def empty(self, shape, dtype: str):
        if self.meta:
            return MetaArray(shape, dtype)
        import cupy
        return cupy.empty(shape, numpy_dtype(dtype))

    def zeros(self, shape, dtype: str):
        if self.meta:
            return MetaArray(shape, dtype)
        import cupy
        return cupy.zeros(shape, numpy_dtype(dtype))

    def positions(self, batch: int, tokens: int):
        """int32 (batch * tokens,) holding 0..tokens-1 for every sequence."""
        if self.meta:
            return MetaArray((batch * tokens,), "int32")
        import cupy
        return cupy.tile(cupy.arange(tokens, dtype=cupy.int32), batch)


META = Arrays(meta=True)


class FP8Activations:
    """Room for a pass's activations quantized to FP8 (W8A8): codes of `rows` rows of the widest quantized
    linear's input, and `groups` fp32 scales per row (1, or one per 128 columns with block-scaled weights)."""

    def __init__(self, rows: int, widest: int, groups: int, arrays: Arrays):
        self.codes = arrays.empty((rows * widest,), "uint8")
        self.scales = arrays.empty((rows * groups,), "float32")

    def views(self, x, groups: int):
        """Buffers for x (M, K) quantized to FP8: codes (M, K) and scales (M, groups)."""
        M, K = x.shape
        return self.codes[:M * K].reshape(M, K), self.scales[:M * groups].reshape(M, groups)


@dataclass(frozen=True)
class KVSpec:
    """A cache of per-head keys and values: for each of `layers`, kv_heads x head_dim values per position (this
    rank's heads, tensor-parallel), in the model's dtype or FP8."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str


@dataclass(frozen=True)
class LatentSpec:
    """Multi-head latent attention's cache (DeepSeek-V2): for each of `layers`, one latent entry per position, the
    `rank` normed latent values then the rotary key (`width` in all), copied in `chunk`-wide heads by write_kv."""

    layers: int
    width: int
    rank: int
    chunk: int
    dtype: str


class CausalLM(LanguageModel):
    """Weights, the shared plumbing of the math and checkpoints of a model that provides the math (see the module doc).

    A subclass names its family's `weights` module and `config_class`, sets `config` (with vocab_size,
    block_size and eos_token_id), `dtype`, `meta` (MetaArray weights) and `params` (every weight under its
    Hugging Face name, _init_weights), and implements cache_spec(), activations(), hidden(), final_norm(),
    lm_head() and meta_twin(). hidden() attends through the attend functions (prefill_attend, decode_attend,
    forward_attend), which default to per-head keys and values (KVSpec: the cache's prefill() and decode(), and
    tilekit's attention without one); a model with another cache (DeepSeek-V2's latent one) overrides all three.
    """

    weights: ModuleType
    config_class: type
    quant: quantization.Scheme | None = None     # quantized linears: how (a subclass that supports it sets it)
    quantized: tuple[str, ...] = ()              # their weights' names (codes; fp32 scales under scale_key(name))
    widest_input: int = 0                        # the widest input (K) of the quantized linears
    parts: dict = {}           # tensor-parallel: name -> (axis, start, stop), the slice of it this rank holds
    vocab: tuple[int, int] = (0, 0)   # tensor-parallel: the vocabulary rows [start, stop) of this rank's LM head
    prefill_chunk = 8192       # prompts longer than this prefill in chunks of it (0: never; engine.static.prefill_pieces)
    comm = None                # tensor-parallel: this rank's tilekit.parallel.Communicator (None: one process)
    shards_quantized = False   # tensor-parallel with quantized linears (a subclass whose sharding supports it)
    kv_scales = None           # a checkpoint's FP8 KV-cache scales: (keys', values') fp32 (layers,), or None

    def _init_comm(self, comm, weights_given: bool) -> int:
        """self.comm (None for one rank), self.parts (the family's weights.shard_parts: what this rank holds of each
        tensor) and self.vocab (its LM head's vocabulary rows); refuses seeded weights (`weights_given`: from state=,
        a checkpoint or meta) and, unless the class shards_quantized, quantized linears. Returns this rank (0 for
        one)."""
        world = 1 if comm is None else comm.world_size
        rank = 0 if comm is None else comm.rank
        self.comm = comm if world > 1 else None
        self.parts = self.weights.shard_parts(self.config, rank, world) if self.comm else {}
        if self.comm and self.quant:
            self.check_shards_quantized("quantize, or an FP8 / INT8 checkpoint")
        if self.comm and not weights_given:
            raise ValueError("a tensor-parallel model's weights come from state= or a checkpoint (from_pretrained), "
                             "not from a seed: each rank holds a slice of the same weights")
        self.vocab = parallel.vocab_span(self.config.vocab_size, rank, world)
        if self.comm:       # NCCL lets a communicator go only once no graph holds its collectives: close() drops ours
            self.comm.hold(self.forget_graphs)
        return rank

    @classmethod
    def check_quantized_config(cls, config, scheme: quantization.Scheme | None) -> None:
        """ValueError where `config`'s shapes cannot take `scheme`'s quantized linears (a family's own rules; from a
        checkpoint, from_pretrained names its config.json)."""

    @classmethod
    def loaded_scheme(cls, checkpoint, config, quantize: str | None = None,
                      quantize_head: bool = False) -> quantization.Scheme | None:
        """The quantization a model of `config` loaded from `checkpoint` (a checkpoints.Checkpoint) with `quantize` and
        `quantize_head` holds, its LM head decided (a quantized checkpoint's: where its file stores codes, read from
        the safetensors headers), or None for float linears; the errors from_pretrained raises for it."""
        scheme = quantization.scheme_for(checkpoint, quantize, mixed=bool(cls.weights.QUANTIZATION.dequantized),
                                         quantize_head=quantize_head)
        quantization.check_head(cls, config, scheme)
        try:
            cls.check_quantized_config(config, scheme)
        except ValueError as e:
            raise ModelFileError(checkpoint.directory / CONFIG_NAME, str(e)) from None
        if scheme is None:
            return None
        if not cls.weights.QUANTIZATION.linears:
            raise ValueError(f"{cls.__name__} has no quantized linears ({scheme.source})")
        if scheme.source != quantization.LOAD_TIME:
            name = cls.weights.PREFIX + LM_HEAD
            with checkpoint.tensor_files() as files:
                stored = files.tensors[name].dtype if name in files.tensors else None
            if stored == quantization.FILE_DTYPES[scheme.weight] and scheme.float_head:
                path, key = scheme.float_head
                raise ModelFileError(path, f"field {quoted(key)} lists the LM head unquantized, but the weights "
                                           f"store {quoted(name)} as {stored} codes")
            scheme = replace(scheme, head=stored == quantization.FILE_DTYPES[scheme.weight])
        return replace(scheme, head=quantization.head_quantized(cls.weights, config, scheme))

    @classmethod
    def check_shards_quantized(cls, source: str) -> None:
        """A tensor-parallel model with quantized linears (from `source`) is refused unless the class shards them."""
        if not cls.shards_quantized:
            raise ValueError(f"{cls.__name__}'s tensor parallelism does not take quantized linears yet ({source})")

    def head_weight(self, embedding, untied=None):
        """The LM head's weight: `untied` (a checkpoint's lm_head, this rank's rows when sharded) or, tied, the token
        embedding's rows of this rank's vocabulary."""
        if untied is not None:
            return untied
        return embedding[self.vocab[0]:self.vocab[1]] if self.comm else embedding

    def lm_head(self, h, out=None):
        """Logits h @ self.head^T (tensor-parallel: this rank's vocabulary rows, then vocab_parallel)."""
        if not self.comm:
            return self.head_product(h, out)
        return self.vocab_parallel(h, out, self.head_product)

    def head_product(self, h, out):
        """h @ head^T into out: linear, or quant_linear (weight-only) for a quantized head."""
        if LM_HEAD in self.quantized:
            return quant_linear(h, self.head, self.params[quantization.scale_key(LM_HEAD)],
                                weight_dtype=self.quant.weight, out=out)
        return linear(h, self.head, weight_layout="out_in", out=out)

    def add_partial(self, x, add: Callable[[], None]) -> None:
        """add() adds a layer's output into the fixed-point residual stream x; tensor-parallel, each rank's partial
        output, the other ranks' into zeros so that the residual counts once, then summed (exact in integers)."""
        if self.comm and self.comm.rank and not self.meta:
            x.fill(0)
        add()
        self.sum_ranks(x)

    def shape_only_comm(self):
        """A parallel.ShapeOnly of this rank's place (meta_twin's), or None for one rank."""
        return self.comm and parallel.ShapeOnly(self.comm.rank, self.comm.world_size)

    def sum_ranks(self, x) -> None:
        """A row-parallel projection's partial products summed over the ranks, in place (one rank: nothing)."""
        if self.comm:
            self.comm.all_reduce(x)

    def sum_ranks_then_norm(self, x, weight, eps: float, out) -> None:
        """sum_ranks(x), then out = RMSNorm(x) * weight: one kernel where the communicator fuses them."""
        if not (self.comm and self.comm.all_reduce_norm(x, weight, eps, out)):
            self.sum_ranks(x)
            rms_norm(x, weight, eps, out=out)

    # -- the cache and attention ----------------------------------------------------------------
    def cache_spec(self) -> KVSpec | LatentSpec:
        """The cache this model's attention keeps (default: per-head keys and values, cache_dims())."""
        layers, heads, head_dim = self.cache_dims()
        return KVSpec(layers, heads, head_dim, self.dtype)

    def prefill_attend(self, cache, start, past: int = 0) -> Callable:
        """hidden()'s attend for a prompt prefill: attend(layer, q, k, v, out) writes the keys and values into the
        cache at `start` (int32 (B,) device offsets) and attends causally over the prompts (cache.prefill); with
        `past` positions of every sequence already cached (a chunk of a longer prompt), over those too."""
        return lambda i, q, k, v, out: cache.prefill(i, q, k, v, out, start, past)

    def decode_attend(self, cache, positions) -> Callable:
        """hidden()'s attend for a decode step: writes k and v at `positions` (each sequence's newest), then
        attends over the cache up to them (cache.decode)."""
        return lambda i, q, k, v, out: cache.decode(i, q, k, v, out, positions)

    def forward_attend(self) -> Callable:
        """hidden()'s attend for forward(): causal attention over whole prompts, no cache."""
        return lambda i, q, k, v, out: attention(q, k, v, causal=True, out=out)

    # -- quantized linears (tilekit.models.quantization) -----------------------------------------
    def _init_quant(self, quantize, building: bool) -> None:
        """self.quant from a constructor's `quantize` (None, "int8", "fp8" or a checkpoint's Scheme) and
        self.quantized: the weights of the family's QUANTIZED modules. Block scales come from checkpoints only
        (`building`: the model is built empty or meta for one)."""
        if isinstance(quantize, str) or quantize is None:
            if quantize not in (None, *quantization.KINDS):
                raise ValueError(f"quantize must be None, 'int8' or 'fp8', got {quantize!r}")
            quantize = quantize and quantization.Scheme(quantize)
        if quantize and quantize.scale == "block" and not building:
            raise ValueError("block-scaled weights come from a checkpoint (from_pretrained)")
        self.quant = quantize
        if quantize:
            self.quantized = quantization.linear_names(self.weights.state_dict_shapes(self.config),
                                                       self.weights.QUANTIZATION.linears)
            if quantization.head_quantized(self.weights, self.config, quantize):
                self.quantized += (LM_HEAD,)

    def _allocate_params(self, groups: Sequence[Sequence[str]], halves: Sequence[Sequence[str]] = ()) -> tuple:
        """self.params: every weight of the family's state_dict_shapes (this rank's slice of those in self.parts),
        uninitialised, under its name, in the
        model's dtype or, for self.quantized, as 8-bit codes with fp32 scales under quantization.scale_key names.
        Each of `groups` (names of weights of one input width, all quantized or none; one GEMM) and of `halves`
        (a quantized SwiGLU's [gate; up], each half with its own block grid) becomes row views of one fused
        matrix, and so do their scales; returns each group's and each halves' (matrix, scales or None)."""
        shapes = {name: parallel.part_shape(shape, self.parts[name]) if name in self.parts else shape
                  for name, shape in self.weights.state_dict_shapes(self.config).items()}
        new, quant = Arrays(self.meta).empty, self.quant
        fused, views = [], {}
        for names, own_grids in [(g, False) for g in groups] + [(h, True) for h in halves]:
            rows, K = [shapes[n][0] for n in names], shapes[names[0]][1]
            coded = quant is not None and names[0] in self.quantized
            matrix = new((sum(rows), K), WEIGHT_DTYPES[quant.weight] if coded else self.dtype)
            scales, per = None, rows
            if coded:
                if quant.scale == "block" and not own_grids and any(r % QBLOCK for r in rows[:-1]):
                    raise ValueError(f"block-scaled {', '.join(names)} need multiples of {QBLOCK} rows to share one "
                                     f"matrix, got {rows}")
                per = rows if quant.scale == "channel" else [-(-r // QBLOCK) for r in rows]
                scales = new((sum(per),) if quant.scale == "channel" else (sum(per), -(-K // QBLOCK)), "float32")
            start = first = 0
            for n, r, b in zip(names, rows, per):
                views[n], start = matrix[start:start + r], start + r
                if coded:
                    views[quantization.scale_key(n)], first = scales[first:first + b], first + b
            fused.append((matrix, scales))
        self.params = {}
        for name, shape in shapes.items():
            if name in views:
                self.params[name] = views[name]
            elif name in self.quantized:
                self.params[name] = new(shape, WEIGHT_DTYPES[quant.weight])
                views[quantization.scale_key(name)] = new(quantization.model_scale_shape(quant.scale, shape),
                                                          "float32")
            else:
                self.params[name] = new(shape, self.dtype)
            if quantization.scale_key(name) in views:
                self.params[quantization.scale_key(name)] = views[quantization.scale_key(name)]
        return fused[:len(groups)], fused[len(groups):]

    def fp8_groups(self, rows: int) -> int:
        """Activation scales per row when `rows` rows run in FP8 (W8A8): 1, or one per 128 columns of the widest
        input with block scales; 0 when they do not (not FP8 weights, or fewer than W8A8_MIN_ROWS rows)."""
        if not self.quant or self.quant.weight != "fp8" or rows < W8A8_MIN_ROWS:
            return 0
        return 1 if self.quant.scale == "channel" else -(-self.widest_input // QBLOCK)

    def fp8_activations(self, rows: int, arrays: Arrays) -> FP8Activations | None:
        """A pass's FP8Activations for `rows` rows, or None when they stay in the model's dtype."""
        groups = self.fp8_groups(rows)
        return FP8Activations(rows, self.widest_input, groups, arrays) if groups else None

    def project(self, fp8: FP8Activations | None, x, w, scale, *, out, residual=None, activation=None):
        """x @ w^T (+ residual) into out: kernels.linear in the model's dtype; quant_linear when quantized, with
        the activations quantized to FP8 into `fp8` (W8A8) for prefill rows of FP8 weights. activation='swiglu'
        (quantized only): w is [gate; up]."""
        if not self.quant:
            return linear(x, w, weight_layout="out_in", residual=residual, out=out)
        x_scale = None
        groups = self.fp8_groups(x.shape[0])
        if groups:
            block = self.quant.scale == "block"
            codes, x_scale = fp8.views(x, -(-x.shape[1] // QBLOCK) if block else 1)
            quantize_fp8(x, codes, x_scale, group=QBLOCK if block else None)
            x = codes
        return quant_linear(x, w, scale, weight_dtype=self.quant.weight, x_scale=x_scale, activation=activation,
                            residual=residual, out=out)

    # -- weights and checkpoints ----------------------------------------------------------------
    def _init_weights(self, state: dict | None, seed: int, empty: bool) -> None:
        """Fill self.params (allocated): from `state` (host arrays under the same names, checked; copied to the
        GPU in their own dtype and converted there), or N(mean, std) drawn on the GPU from `seed` (the family's
        weight_stats), or not at all (empty: from_pretrained streams a checkpoint into them). The quantized
        linears are quantized per channel on the GPU."""
        if state is not None:
            if empty:
                raise ValueError("pass state= or empty=True, not both")
            self.weights.check_state_dict(self.config, state)
        if self.meta or empty:
            return
        import cupy
        rng = cupy.random.default_rng(seed)
        scales = {quantization.scale_key(name) for name in self.quantized}
        for name, out in self.params.items():
            if name in scales:
                continue
            if state is not None:
                part = self.parts.get(name)
                host = state[name] if part is None else parallel.take_part(np.asarray(state[name]), part)
                src = cupy.asarray(np.ascontiguousarray(host))
            else:
                mean, std = self.weights.weight_stats(self.config, name)
                src = rng.standard_normal(out.shape, dtype=cupy.float32) * std + mean
            if name in self.quantized:
                quantization.quantize_into(src.astype(cupy.float32), out, self.params[quantization.scale_key(name)],
                                           self.quant.weight)
            else:
                convert(src, out)

    @classmethod
    def from_pretrained(cls, path_or_name, *, dtype: str = "bfloat16", quantize: str | None = None,
                        quantize_head: bool = False, **kwargs) -> "CausalLM":
        """The model of a Hugging Face checkpoint: a directory (single-file or sharded safetensors), a model name
        in the local hub cache, or a checkpoints.Checkpoint. Its config.json is read field by field; once the
        safetensors headers match the config, the model's device arrays are allocated and the tensors streamed
        into them in `dtype`, never the whole checkpoint on the host. An FP8 / INT8 checkpoint
        (tilekit.models.quantization) loads quantized (its LM head as the file stores it); quantize="int8" | "fp8"
        quantizes a float one per channel as it streams in, with quantize_head=True its untied LM head too (a
        family whose weights.QUANTIZATION.head allows it); linears the family keeps in its dtype (its dequantized) are
        dequantized as they load; a quantized checkpoint's static FP8 KV-cache scales (quantization.read_kv_scales)
        become kv_scales, the FP8 KV cache's. kwargs go to the constructor; with a tensor-parallel `comm` among them, only this
        rank's slices of the tensors are read (the family's weights.shard_parts), of a quantized linear its codes
        and their scales (quantization.scale_part), quantize= quantizing the slice. The arguments are checked
        before any file is read."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        quantization.check_arguments(quantize, quantize_head)
        taken = sorted(set(kwargs) & {"state", "empty", "meta", "quantize"})
        if taken:
            raise TypeError(f"from_pretrained sets {', '.join(taken)} itself (the checkpoint's weights, streamed in)")
        if not isinstance(kwargs.get("comm"), (parallel.Communicator, type(None))):
            raise TypeError(f"comm must be a tilekit.parallel.Communicator, got {type(kwargs['comm']).__name__}")
        checkpoint = cls.weights.resolve(path_or_name)
        config = cls.config_class.from_fields(checkpoint.config())
        scheme = cls.loaded_scheme(checkpoint, config, quantize, quantize_head)
        rules = cls.weights.QUANTIZATION
        dequantized = rules.dequantized
        linears = () if scheme is None else quantization.linear_names(cls.weights.state_dict_shapes(config),
                                                                      rules.linears)
        comm = kwargs.get("comm")
        parts = None
        if comm is not None and comm.world_size > 1:
            if not hasattr(cls.weights, "shard_parts"):
                raise ValueError(f"{cls.__name__} models have no tensor parallelism")
            if scheme is not None:
                cls.check_shards_quantized(scheme.source)
            parts = cls.weights.shard_parts(config, comm.rank, comm.world_size)
        made = []

        def rewrite(plan, outs, dtypes):
            """The plan with the linears quantized, the LM head too where the scheme holds it quantized."""
            return quantization.rewrite_plan(plan, linears + ((LM_HEAD,) if scheme.head else ()), scheme, outs, dtypes,
                                             dequantized)

        def allocate() -> dict:
            if scheme is not None:
                kwargs["quantize"] = scheme
            made.append(cls(config, dtype=dtype, empty=True, **kwargs))
            return made[0].params
        options = {} if parts is None else {"parts": parts}
        kv_scales = None            # read first: a bad one is refused before the weights stream in
        if scheme is not None and scheme.kv_scales and rules.kv_scales is not None:
            kv_scales = quantization.read_kv_scales(checkpoint, cls.weights.layer_prefixes(config), rules.kv_scales)
        cls.weights.load(checkpoint, config, dtype=dtype, outs=allocate, ignore=scheme.ignored if scheme else (),
                         rewrite=scheme and rewrite, **options)
        made[0].checkpoint, made[0].kv_scales = checkpoint, kv_scales
        return made[0]

    def state_dict(self) -> dict[str, np.ndarray]:
        """float32 host copies of every weight, under the Hugging Face names (quantized ones dequantized)."""
        import cupy
        if not self.quant:
            return {name: cupy.asnumpy(array).astype(np.float32) for name, array in self.params.items()}
        scales = {quantization.scale_key(name) for name in self.quantized}
        return {name: dequantize_reference(cupy.asnumpy(array), cupy.asnumpy(
                    self.params[quantization.scale_key(name)]), self.quant.weight).astype(np.float32)
                if name in self.quantized else cupy.asnumpy(array).astype(np.float32)
                for name, array in self.params.items() if name not in scales}

    def save_pretrained(self, directory) -> None:
        """Write config.json and model.safetensors in the model's dtype, as Hugging Face's save_pretrained does
        (one tensor at a time through the host); a quantized model's linears as a compressed-tensors checkpoint
        (codes and fp32 scales; the family's layout as its files keep it, weights.LAYOUT.to_file), which
        from_pretrained reads back. A tensor-parallel rank holds slices only: refused."""
        if self.comm:
            raise ValueError("save_pretrained of a tensor-parallel model: each rank holds only its slices of the "
                             "weights; save from a one-rank model (no comm), loaded the same way")
        if not self.quant:
            if self.kv_scales is not None:
                raise ValueError("kv_scales are saved with a quantized model's compressed-tensors checkpoint; this "
                                 "model's linears are not quantized")
            self.weights.save_state_dict(directory, self.config, self.params, dtype=self.dtype)
            return
        tensors, raw = quantization.file_tensors(self.params, self.quantized, self.quant)
        if self.weights.LAYOUT.to_file is not None:
            tensors = self.weights.LAYOUT.to_file(self.config, tensors)
        dequantized = self.weights.QUANTIZATION.dequantized
        hf_config = dict(self.config.to_hf_dict(), torch_dtype=self.dtype,
                         quantization_config=quantization.compressed_tensors_config(
                             self.quant, dequantized, LM_HEAD in self.quantized, self.kv_scales is not None))
        prefix = self.weights.PREFIX
        tensors, raw = {prefix + n: a for n, a in tensors.items()}, {prefix + n: code for n, code in raw.items()}
        if self.kv_scales is not None:      # compressed-tensors' names (checkpoint names: the prefix is in them)
            if self.weights.QUANTIZATION.kv_scales is None:
                raise ValueError(f"kv_scales: {type(self).__name__} checkpoints keep no KV-cache scales")
            layers = self.weights.layer_prefixes(self.config)
            for layer, k, v in zip(layers, *quantization.checked_kv_scales(self.kv_scales, len(layers))):
                for (suffix, *_), value in zip(self.weights.QUANTIZATION.kv_scales, (k, v)):
                    tensors[layer + suffix], raw[layer + suffix] = np.float32(value).reshape(()), "F32"
        write_checkpoint(directory, hf_config, tensors, dtype=self.dtype, raw=raw)

    # -- tensor parallelism ---------------------------------------------------------------------
    def vocab_parallel(self, h, out, project):
        """A vocabulary-sharded LM head: project(h, columns) writes this rank's logits into its columns of out
        (C-contiguous (rows, vocab_size); None: a new array), the other columns are zeroed, and one all-reduce fills
        them in. x + 0 is exact, so every rank then holds the same logits and its next-token kernel picks the same
        token, sampling included, with no broadcast; an all-gather would move half the bytes but land the slices
        rank-major, not as the (rows, V) the pick reads. On the current stream: a captured step holds it."""
        v0, v1 = self.vocab
        if out is None:
            out = Arrays(self.meta).empty((h.shape[0], self.config.vocab_size), self.dtype)
        if not self.meta:           # zero bits are +0 in every float dtype: an integer fill, for any dtype
            bits = out.view(f"u{out.dtype.itemsize}")
            bits[:, :v0] = 0
            bits[:, v1:] = 0
        project(h, out[:, v0:v1])
        return self.comm.all_reduce(out)

    # -- running: thin calls into the engine's runner ---------------------------------------------------------
    def __call__(self, ids, **kwargs):
        return self.forward(ids, **kwargs)

    def forward(self, ids, *, use_graph: bool = True):
        """Logits (B, T, vocab_size) for token ids (B, T): tilekit.engine.static.StaticRunner.forward."""
        return self.runner.forward(ids, use_graph=use_graph)

    def forget_graphs(self) -> None:
        """Drop every captured graph and kept generation buffer of this model's runner (the next calls capture
        anew)."""
        if self._runner is not None:
            self._runner.forget_graphs()

    def kernel_problems(self, batch: int, seq_len: int, new_tokens: int | None = None) -> list[tuple]:
        """(op, problem) of every kernel call of forward() on (batch, seq_len) ids, or, with new_tokens, of
        generate(): tilekit.engine.workload.kernel_problems."""
        return self.runner.kernel_problems(batch, seq_len, new_tokens)

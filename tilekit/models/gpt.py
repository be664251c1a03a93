"""GPT-2 on tilekit's cuTile kernels: prefill, KV-cache decode, CUDA-graph generation.

Every op of the forward pass is a tilekit kernel dispatched with the config the tuning database
holds for this GPU and shape; CuPy only allocates memory and moves data. Names follow the Hugging
Face checkpoint (wte, wpe, h.i.ln_1, attn.c_attn, ...), weights stay [in, out] as stored, and the
LM head reads wte in place.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from tilekit.kernels import (attention, decode_attention, embedding, greedy_step, layer_norm, linear,
                             write_kv)
from tilekit.kernels.arrays import numpy_dtype, release_scratch
from tilekit.models.checkpoint import (check_state_dict, load_state_dict, random_state_dict,
                                       resolve_checkpoint, save_state_dict)
from tilekit.models.config import GPTConfig

DTYPES = ("bfloat16", "float16", "float32")


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


class KVCache:
    """Keys and values of every layer for B sequences, preallocated to `capacity` positions."""

    def __init__(self, config: GPTConfig, batch: int, capacity: int, dtype: str):
        import cupy
        shape = (config.n_layer, batch, config.n_head, capacity, config.head_dim)
        # zeroed: decode attention multiplies whole key tiles, unwritten slots included, by
        # probabilities that are 0 there, and 0 x NaN from stale memory would be NaN
        self.k = cupy.zeros(shape, dtype=numpy_dtype(dtype))
        self.v = cupy.zeros(shape, dtype=numpy_dtype(dtype))
        self.capacity = capacity


class Activations:
    """The blocks' working buffers for B sequences of T tokens, allocated once so that a pass over
    the blocks allocates nothing and can be captured as a CUDA graph."""

    def __init__(self, config: GPTConfig, batch: int, tokens: int, dtype: str):
        import cupy
        shape, dt, C = (batch, tokens), numpy_dtype(dtype), config.n_embd
        self.x, self.other, self.h, self.y = (cupy.empty(shape + (C,), dt) for _ in range(4))
        self.qkv = cupy.empty(shape + (3 * C,), dt)
        self.f = cupy.empty(shape + (4 * C,), dt)


_DLPACK_GPU_DEVICES = (2, 3, 13)   # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def _host_array(x, name: str) -> np.ndarray:
    """NumPy copy of host or device data (NumPy, lists, CuPy, torch on CPU or GPU, any DLPack GPU array)."""
    try:
        if hasattr(x, "__cuda_array_interface__"):
            import cupy
            return cupy.asnumpy(cupy.asarray(x))
        if hasattr(x, "__dlpack_device__") and x.__dlpack_device__()[0] in _DLPACK_GPU_DEVICES:
            import cupy
            return cupy.asnumpy(cupy.from_dlpack(x))
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be an integer array (NumPy, CuPy, torch or nested lists): {e}") from None


class GPT:
    """A GPT-2 family model whose forward pass runs entirely on tilekit kernels."""

    def __init__(self, config: GPTConfig, *, dtype: str = "bfloat16", seed: int = 0,
                 state: dict[str, np.ndarray] | None = None, allow_tf32: bool = False):
        """Random GPT-2 initialisation from `seed`, or the given state dict (canonical HF names)."""
        import cupy
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if allow_tf32 and dtype != "float32":
            raise ValueError("allow_tf32 applies to dtype='float32' only")
        if state is None:
            state = random_state_dict(config, seed)
        check_state_dict(config, state)
        self.config, self.dtype, self.allow_tf32 = config, dtype, allow_tf32
        self.device = cupy.cuda.runtime.getDevice()
        self.checkpoint_dir: Path | None = None
        self._graphs: OrderedDict[tuple, PrefillGraph] = OrderedDict()
        self._generations: OrderedDict[tuple, Generation] = OrderedDict()
        self._graphs_lock = threading.Lock()
        host_dtype = numpy_dtype(dtype)
        w = {name: cupy.asarray(np.ascontiguousarray(a, dtype=np.float32).astype(host_dtype))
             for name, a in state.items()}
        self.wte, self.wpe = w["wte.weight"], w["wpe.weight"]
        self.ln_f_w, self.ln_f_b = w["ln_f.weight"], w["ln_f.bias"]
        self.blocks = [Block(*(w[f"h.{i}.{n}"] for n in BLOCK_PARAMS)) for i in range(config.n_layer)]

    # -- checkpoints ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_name: str | Path, *, dtype: str = "bfloat16",
                        allow_tf32: bool = False) -> "GPT":
        """Load a local Hugging Face GPT-2 checkpoint directory or a model in the local HF cache."""
        directory = resolve_checkpoint(path_or_name)
        config, state = load_state_dict(directory)
        model = cls(config, dtype=dtype, state=state, allow_tf32=allow_tf32)
        model.checkpoint_dir = directory
        return model

    def state_dict(self) -> dict[str, np.ndarray]:
        """float32 host copies of every parameter, under the Hugging Face names."""
        def host(a):
            return a.get().astype(np.float32)
        state = {"wte.weight": host(self.wte), "wpe.weight": host(self.wpe),
                 "ln_f.weight": host(self.ln_f_w), "ln_f.bias": host(self.ln_f_b)}
        for i, block in enumerate(self.blocks):
            for name, array in zip(BLOCK_PARAMS, vars(block).values()):
                state[f"h.{i}.{name}"] = host(array)
        return state

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json and model.safetensors in the Hugging Face GPT-2 format."""
        save_state_dict(directory, self.config, self.state_dict())

    # -- forward --------------------------------------------------------------------------------
    def __call__(self, ids, **kwargs):
        return self.forward(ids, **kwargs)

    def forward(self, ids, *, use_graph: bool = True):
        """Logits (B, T, vocab_size) for token ids (B, T) (host or device integers).

        The first call at a given (B, T) on a stream runs the blocks eagerly and captures them as a
        CUDA graph; later calls replay it (the last max_prefill_graphs shapes are kept) and launch
        only the LM head on its own, into a fresh logits array. use_graph=False runs every kernel
        one by one. Graphs hold the configs chosen when they were captured: forget_graphs() after
        changing the tuning database or TILEKIT_AUTOTUNE in this process.
        """
        import cupy
        ids_host = self._check_ids(ids).astype(np.int32)
        B, T = ids_host.shape
        stream = cupy.cuda.get_current_stream()
        if use_graph:
            logits = self._prefill_graph(B, T, stream).run(ids_host, stream)
            if logits is not None:           # None: another thread evicted the graph meanwhile
                return logits
        acts = Activations(self.config, B, T, self.dtype)
        self._normed_hidden(acts, cupy.asarray(ids_host), _positions(B, T))
        return self._linear(acts.h, self.wte, weight_layout="out_in")

    max_prefill_graphs = 4

    def _prefill_graph(self, B: int, T: int, stream) -> "PrefillGraph":
        key = (B, T, stream.ptr)
        with self._graphs_lock:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = PrefillGraph(self, B, T)
                while len(self._graphs) > self.max_prefill_graphs:
                    self._graphs.popitem(last=False)[1].release()
            self._graphs.move_to_end(key)
            return graph

    max_generations = 2

    @contextlib.contextmanager
    def _generation(self, batch: int, capacity: int, eos: int, greedy: bool):
        """A Generation for this call: the kept one for the key if no other call holds it, else a new one.
        It is kept again when the call ends normally and dropped when the call fails."""
        key = (batch, capacity, eos, greedy)
        with self._graphs_lock:
            gen = self._generations.pop(key, None)
        if gen is None:
            gen = Generation(self, batch, capacity, eos, greedy)
        try:
            yield gen
        except BaseException:
            gen.release()
            raise
        with self._graphs_lock:
            if key in self._generations:
                self._generations.pop(key).release()
            self._generations[key] = gen
            while len(self._generations) > self.max_generations:
                self._generations.popitem(last=False)[1].release()

    def forget_graphs(self) -> None:
        """Drop every captured graph and kept generation buffer (the next calls capture anew)."""
        with self._graphs_lock:
            for graph in self._graphs.values():
                graph.release()
            self._graphs.clear()
            for gen in self._generations.values():
                gen.release()
            self._generations.clear()

    def _linear(self, x, w, b=None, **kw):
        return linear(x, w, b, allow_tf32=self.allow_tf32, **kw)

    def _normed_hidden(self, acts: Activations, ids, positions) -> None:
        """forward() up to the LM head: the blocks over whole prompts (no KV cache), then the final
        LayerNorm into acts.h."""
        x = self._blocks(acts, ids, positions, lambda i, q, k, v, out: attention(q, k, v, causal=True, out=out))
        layer_norm(x, self.ln_f_w, self.ln_f_b, self.config.layer_norm_epsilon, out=acts.h)

    def _blocks(self, acts: Activations, ids, positions, attend):
        """Embed ids at positions and run every block in `acts`; returns acts.x, the hidden states.

        attend(layer, q, k, v, out) writes attention for one layer into out (B, H, T, D) and fills
        a KV cache where there is one."""
        cfg = self.config
        B, T = ids.shape
        H, D, eps = cfg.n_head, cfg.head_dim, cfg.layer_norm_epsilon
        x, other = acts.x, acts.other
        embedding(ids, self.wte, self.wpe, positions, out=x)
        heads = acts.y.reshape(B, T, H, D).transpose(0, 2, 1, 3)
        for i, blk in enumerate(self.blocks):
            layer_norm(x, blk.ln_1_w, blk.ln_1_b, eps, out=acts.h)
            self._linear(acts.h, blk.attn_w, blk.attn_b, out=acts.qkv)
            q, k, v = (acts.qkv.reshape(B, T, 3, H, D)[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
            attend(i, q, k, v, heads)
            self._linear(acts.y, blk.proj_w, blk.proj_b, residual=x, out=other)
            x, other = other, x
            layer_norm(x, blk.ln_2_w, blk.ln_2_b, eps, out=acts.h)
            self._linear(acts.h, blk.fc_w, blk.fc_b, activation="gelu", out=acts.f)
            self._linear(acts.f, blk.mlp_proj_w, blk.mlp_proj_b, residual=x, out=other)
            x, other = other, x
        return x                  # an even number of swaps: acts.x

    # -- generation -----------------------------------------------------------------------------
    def generate(self, ids, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | None = None, seed: int | None = None,
                 use_graph: bool = True, on_token: Callable[[np.ndarray], None] | None = None):
        """Continue each prompt by up to `max_new_tokens` tokens with a KV cache.

        ids: a 2-D integer array (B, T) of equal-length prompts, or a list of token lists of
        different lengths. temperature 0 is greedy (argmax on the GPU); otherwise tokens are sampled
        (with optional top_k / top_p) from the softmax at that temperature on the host. A sequence
        stops after emitting eos_token_id. on_token(tokens) is called with the (B,) new tokens of
        each step. Returns a list of 1-D int arrays (prompt + continuation).

        The KV cache and buffers for (batch, capacity) are kept for the next call (the last
        max_generations of them; forget_graphs() frees them). After its first run the decode step
        is one CUDA graph replay, and so is the prompt prefill once a padded prompt length (a
        multiple of 64) repeats; use_graph=False runs every kernel one by one.
        """
        prompts = self._check_prompts(ids)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
        if eos_token_id is not None and not 0 <= eos_token_id < self.config.vocab_size:
            raise ValueError(f"eos_token_id must be in [0, {self.config.vocab_size}), got {eos_token_id}")
        lengths = np.array([len(p) for p in prompts], np.int32)
        need = int(lengths.max()) + max_new_tokens
        if need > self.config.block_size:
            raise ValueError(f"prompt length {int(lengths.max())} + max_new_tokens {max_new_tokens} "
                             f"exceeds block_size {self.config.block_size}")
        if max_new_tokens == 0:
            return [np.asarray(p, np.int64) for p in prompts]
        B, T0 = len(prompts), int(lengths.max())
        capacity = min(self.config.block_size, -(-need // 64) * 64)
        T = min(capacity, -(-T0 // 64) * 64)      # prompts padded to a multiple of 64: few prefill shapes
        greedy = temperature == 0
        eos = -1 if eos_token_id is None else eos_token_id
        rng = np.random.default_rng(seed)
        padded = np.zeros((B, T), np.int32)
        for b, p in enumerate(prompts):
            padded[b, :len(p)] = p
        pos = lengths - 1                      # position of each sequence's newest token
        history = np.zeros((B, capacity + 1), np.int32)
        history[:, :T] = padded
        finished = np.zeros(B, bool)

        def pick_on_host():
            nonlocal pos
            new = _sample(gen.logits.get().astype(np.float64), temperature, top_k, top_p, rng)
            new = np.where(finished, eos, new).astype(np.int32)
            pos = pos + 1
            history[np.arange(B), pos] = new
            gen.tokens.set(new)
            gen.positions.set(pos.astype(np.int32))
            return new

        with self._generation(B, capacity, eos, greedy) as gen, gen.stream:
            gen.start(history, pos)
            gen.prefill(padded, np.arange(B, dtype=np.int32) * T + pos, use_graph)
            produced = 0
            while True:
                new = None if greedy else pick_on_host()
                produced += 1
                if on_token is not None or produced % 8 == 0 or produced == max_new_tokens:
                    if greedy:
                        new = gen.tokens.get()
                        finished |= gen.finished.get().astype(bool)
                    if on_token is not None:
                        on_token(new)
                if not greedy and eos_token_id is not None:
                    finished |= new == eos
                if produced == max_new_tokens or finished.all():
                    break
                gen.decode(use_graph)
            gen.stream.synchronize()
            if greedy:
                history = gen.history.get()
        out = []
        for b in range(B):
            seq = history[b, :lengths[b] + produced].astype(np.int64)
            hits = np.flatnonzero(seq[lengths[b]:] == eos) if eos_token_id is not None else []
            out.append(seq[:lengths[b] + hits[0] + 1] if len(hits) else seq)
        return out

    def generate_text(self, prompt: str, max_new_tokens: int = 50, *, stream_to: Callable[[str], None] | None = None,
                      **kwargs) -> str:
        """Tokenize `prompt` with the checkpoint's own tokenizer, generate, and decode."""
        tokenizer = self.tokenizer()
        ids = tokenizer.encode(prompt).ids
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        eos = kwargs.pop("eos_token_id", self._eos_id(tokenizer))
        def on_token(tokens):
            stream_to(tokenizer.decode([int(tokens[0])]))
        seq = self.generate([ids], max_new_tokens, eos_token_id=eos,
                            on_token=on_token if stream_to is not None else None, **kwargs)[0]
        return tokenizer.decode(seq[len(ids):].tolist())

    def tokenizer(self):
        """The checkpoint's tokenizer (tokenizer.json, or vocab.json + merges.txt) via `tokenizers`."""
        from tokenizers import Tokenizer
        from tokenizers.decoders import ByteLevel as ByteLevelDecoder
        from tokenizers.models import BPE
        from tokenizers.pre_tokenizers import ByteLevel
        if self.checkpoint_dir is None:
            raise ValueError("this model has no checkpoint directory to read a tokenizer from "
                             "(use GPT.from_pretrained)")
        d = self.checkpoint_dir
        if (d / "tokenizer.json").is_file():
            return Tokenizer.from_file(str(d / "tokenizer.json"))
        if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
            tok = Tokenizer(BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
            tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
            tok.decoder = ByteLevelDecoder()
            return tok
        raise FileNotFoundError(f"no tokenizer.json or vocab.json + merges.txt in {d}")

    @staticmethod
    def _eos_id(tokenizer) -> int | None:
        return tokenizer.token_to_id("<|endoftext|>")

    # -- validation -----------------------------------------------------------------------------
    def _check_ids(self, ids) -> np.ndarray:
        """Host int64 copy of (B, T) ids after checking dtype, shape, range and length."""
        ids = _host_array(ids, "ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
        if ids.ndim != 2 or ids.size == 0:
            raise ValueError(f"ids must be a non-empty 2-D (batch, time) array, got shape {ids.shape}")
        self._check_range(ids, "ids")
        return ids.astype(np.int64)

    def _check_prompts(self, ids) -> list[np.ndarray]:
        if isinstance(ids, (list, tuple)) and ids and all(isinstance(p, (list, tuple, np.ndarray)) for p in ids):
            prompts = [np.asarray(p) for p in ids]
            for b, p in enumerate(prompts):
                if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
                    raise ValueError(f"ids[{b}] must be a non-empty 1-D list of token ids")
                self._check_range(p, f"ids[{b}]")
            return prompts
        return list(self._check_ids(ids))

    def _check_range(self, ids: np.ndarray, name: str) -> None:
        if ids.shape[-1] > self.config.block_size:
            raise ValueError(f"{name} has {ids.shape[-1]} positions, more than block_size {self.config.block_size}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"{name} must lie in [0, {self.config.vocab_size}), got values in "
                             f"[{ids.min()}, {ids.max()}]")


def _positions(batch: int, tokens: int):
    """int32 (batch, tokens) device array of 0..tokens-1 in every row."""
    import cupy
    return cupy.broadcast_to(cupy.arange(tokens, dtype=cupy.int32), (batch, tokens)).copy()


def _capture(stream, fn) -> object:
    """fn()'s kernels on `stream` recorded as a CUDA graph (nothing runs)."""
    stream.begin_capture()
    try:
        fn()
    except BaseException:
        stream.end_capture()
        raise
    return stream.end_capture()


class PromptBuffers:
    """Static inputs and activations of one padded prompt shape, and its prefill graph once captured."""

    def __init__(self, model: GPT, batch: int, tokens: int):
        import cupy
        self.ids = cupy.zeros((batch, tokens), cupy.int32)
        self.positions = _positions(batch, tokens)
        self.last = cupy.zeros((batch,), cupy.int32)          # row of each sequence's newest token
        self.zeros = cupy.zeros((batch,), cupy.int32)         # KV cache write offsets
        self.acts = Activations(model.config, batch, tokens, model.dtype)
        self.graph, self.runs = None, 0


class Generation:
    """generate()'s device state for B sequences of up to `capacity` positions, on its own stream:
    the KV cache, the decode buffers, and CUDA graphs of the decode step and of prompt prefills."""

    max_prompt_shapes = 2

    def __init__(self, model: GPT, batch: int, capacity: int, eos: int, greedy: bool):
        import cupy
        cfg = model.config
        self.model, self.batch, self.eos, self.greedy = model, batch, eos, greedy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.cache = KVCache(cfg, batch, capacity, model.dtype)
            self.tokens = cupy.zeros((batch,), cupy.int32)
            self.positions = cupy.zeros((batch,), cupy.int32)
            self.finished = cupy.zeros((batch,), cupy.int32)
            self.history = cupy.zeros((batch, capacity + 1), cupy.int32)
            self.acts = Activations(cfg, batch, 1, model.dtype)
            self.logits = cupy.empty((batch, cfg.vocab_size), numpy_dtype(model.dtype))
        self.prompts: OrderedDict[int, PromptBuffers] = OrderedDict()
        self.decode_graph = None
        weakref.finalize(self, release_scratch, self.stream.ptr)   # also when dropped unreleased

    def start(self, history: np.ndarray, positions: np.ndarray) -> None:
        """A new call: the prompts in history, each sequence's newest position, nothing finished."""
        self.history.set(history)
        self.positions.set(positions)
        self.finished.fill(0)

    def prefill(self, ids: np.ndarray, last: np.ndarray, use_graph: bool) -> None:
        """Fill the KV cache from padded prompts ids (B, T) and compute the logits at rows `last`
        (of the flattened B x T tokens); greedy generations also pick the first token."""
        T = ids.shape[1]
        buf = self.prompts.pop(T, None) or PromptBuffers(self.model, self.batch, T)
        self.prompts[T] = buf
        while len(self.prompts) > self.max_prompt_shapes:
            self.prompts.popitem(last=False)
        buf.ids.set(ids)
        buf.last.set(last)
        if use_graph and buf.graph is not None:
            buf.graph.launch(self.stream)
            return
        self._prefill(buf)
        buf.runs += 1
        if use_graph and buf.runs >= 2:        # a prompt shape seen twice: replay it from now on
            buf.graph = _capture(self.stream, lambda: self._prefill(buf))

    def _prefill(self, buf: PromptBuffers) -> None:
        m, cache = self.model, self.cache

        def attend(i, q, k, v, out):
            write_kv(k, v, cache.k[i], cache.v[i], buf.zeros)
            attention(q, k, v, causal=True, out=out)

        x = m._blocks(buf.acts, buf.ids, buf.positions, attend)
        self._head(x, rows=buf.last)

    def _head(self, x, rows=None) -> None:
        """Final LayerNorm (of `rows` only, when given), LM head logits, and the greedy pick."""
        m, B = self.model, self.batch
        h = self.acts.h.reshape(B, m.config.n_embd)
        layer_norm(x, m.ln_f_w, m.ln_f_b, m.config.layer_norm_epsilon, rows=rows,
                   out=h if rows is not None else self.acts.h)
        m._linear(h, m.wte, weight_layout="out_in", out=self.logits)
        if self.greedy:
            greedy_step(self.logits, self.tokens, self.positions, self.history, self.finished, self.eos)

    def decode(self, use_graph: bool) -> None:
        """One token for every sequence; the first call runs eagerly and captures the step."""
        if use_graph and self.decode_graph is not None:
            self.decode_graph.launch(self.stream)
            return
        self._step()
        if use_graph:
            self.decode_graph = _capture(self.stream, self._step)

    def _step(self) -> None:
        m, cache, B = self.model, self.cache, self.batch

        def attend(i, q, k, v, out):
            write_kv(k, v, cache.k[i], cache.v[i], self.positions)
            decode_attention(q, cache.k[i], cache.v[i], self.positions, length_offset=1, out=out)

        self._head(m._blocks(self.acts, self.tokens.reshape(B, 1), self.positions.reshape(B, 1), attend))

    def release(self) -> None:
        """Wait for this generation's work, then drop its graphs and its stream's work arrays."""
        self.stream.synchronize()
        self.decode_graph = None
        self.prompts.clear()
        release_scratch(self.stream.ptr)


class PrefillGraph:
    """forward() at one (B, T) on one caller stream: static ids and activations, the blocks and the
    final LayerNorm as one CUDA graph, captured on a private stream at the first run."""

    def __init__(self, model: GPT, batch: int, tokens: int):
        import cupy
        self.model, self.shape = model, (batch, tokens)
        self.capture_stream = cupy.cuda.Stream(non_blocking=True)
        with self.capture_stream:
            self.ids = cupy.zeros(self.shape, cupy.int32)
            self.positions = _positions(batch, tokens)
            self.acts = Activations(model.config, batch, tokens, model.dtype)
        self.graph, self.last_run, self.released = None, None, False
        self.lock = threading.Lock()
        weakref.finalize(self, release_scratch, self.capture_stream.ptr)

    def _body(self) -> None:
        self.model._normed_hidden(self.acts, self.ids, self.positions)

    def _capture(self):
        """One eager pass first (compiles kernels, creates their per-stream scratch), then capture."""
        with self.capture_stream:
            self._body()
            return _capture(self.capture_stream, self._body)

    def run(self, ids: np.ndarray, stream):
        """Logits for host int32 ids of this shape, enqueued on `stream`; None once released."""
        with self.lock:            # ids upload, replay and LM head stay together per caller
            if self.released:
                return None
            if self.graph is None:
                graph = self._capture()
                stream.wait_event(self.capture_stream.record())
                self.graph = graph
            elif self.last_run is not None:      # one handle may name several streams (per-thread
                stream.wait_event(self.last_run)  # default streams): order after the previous run
            with stream:
                self.ids.set(ids)
                self.graph.launch(stream)
                logits = self.model._linear(self.acts.h, self.model.wte, weight_layout="out_in")
                self.last_run = stream.record()
                return logits

    def release(self) -> None:
        """Wait for the last run that reads this graph's buffers, then drop the graph."""
        with self.lock:
            self.released = True
            self.capture_stream.synchronize()
            if self.last_run is not None:
                self.last_run.synchronize()
            self.graph = None
            release_scratch(self.capture_stream.ptr)


def _sample(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None,
            rng: np.random.Generator) -> np.ndarray:
    """One token per row from softmax(logits / temperature), restricted to top_k / nucleus top_p."""
    out = np.empty(logits.shape[0], np.int64)
    for b, row in enumerate(logits):
        z = row / temperature
        if top_k is not None and top_k < z.size:
            kth = np.partition(z, -top_k)[-top_k]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max())
        p /= p.sum()
        if top_p is not None and top_p < 1:
            order = np.argsort(-p)
            keep = np.cumsum(p[order]) - p[order] < top_p
            mask = np.zeros_like(p, bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        out[b] = rng.choice(p.size, p=p)
    return out

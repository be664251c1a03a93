"""The KV caches of static batches: B sequences, each preallocated to `capacity` positions, built from the cache a
model asks for (models.base.KVSpec: per-head keys and values; LatentSpec: DeepSeek-V2's latent entries), with the
attention calls through them that a model's attend functions make (prefill, decode; write and decode for the latent
one). The paged caches of continuous batching are tilekit.engine.paged.
"""

from __future__ import annotations

import numpy as np

from tilekit.kernels import attention, decode_attention, mla_decode_attention, write_kv
from tilekit.models import quantization
from tilekit.models.base import Arrays, KVSpec, LatentSpec

KV_CACHE_DTYPES = ("auto", "fp8")
# The FP8 cache's scale of every (layer, key/value head), keys and values alike, where the checkpoint gives none
# (CausalLM.kv_scales: a quantized checkpoint's static scale of each layer): 1.0, vLLM's uncalibrated default.
# Values beyond +-448 x scale saturate; magnitudes below 2^-6 x scale (e4m3's smallest normal) keep an absolute step
# of 2^-9 x scale rather than 3 significant bits (README: the accuracy measured). None is computed from the prompt.
FP8_KV_SCALE = 1.0


def check_kv_cache_dtype(dtype: str) -> None:
    if dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {dtype!r}")


def fp8_scales(kv_scales, layers: int, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 (layers, heads) scales of an FP8 cache's keys and values: the checkpoint's per layer (kv_scales), else
    FP8_KV_SCALE."""
    k, v = (np.full(layers, FP8_KV_SCALE),) * 2 if kv_scales is None else \
        quantization.checked_kv_scales(kv_scales, layers)
    return tuple(np.repeat(np.float32(s)[:, None], heads, 1) for s in (k, v))


class KVCache:
    """Keys and values of every layer for B sequences, preallocated to `capacity` positions: in the model's dtype
    ("auto"), or "fp8": e4m3 codes as uint8 with fp32 scales k_scale, v_scale (layers, key/value heads), value =
    code x scale (the checkpoint's scale of each layer, model.kv_scales, else FP8_KV_SCALE), half the bytes a decode
    step reads."""

    def __init__(self, spec: KVSpec, batch: int, capacity: int, arrays: Arrays, dtype: str = "auto",
                 kv_scales=None):
        check_kv_cache_dtype(dtype)
        layers, heads = spec.layers, spec.kv_heads
        shape = (layers, batch, heads, capacity, spec.head_dim)
        # zeroed: decode attention multiplies whole key tiles, unwritten slots included, by
        # probabilities that are 0 there, and 0 x NaN from stale memory would be NaN
        codes = "uint8" if dtype == "fp8" else spec.dtype
        self.k, self.v = arrays.zeros(shape, codes), arrays.zeros(shape, codes)
        self.k_scale = self.v_scale = None
        if dtype == "fp8":
            self.k_scale, self.v_scale = arrays.zeros((layers, heads), "float32"), arrays.zeros((layers, heads), "float32")
            if not arrays.meta:
                import cupy
                k, v = fp8_scales(kv_scales, layers, heads)
                self.k_scale[...], self.v_scale[...] = cupy.asarray(k), cupy.asarray(v)
        self.capacity = capacity

    @property
    def chunked_prefill(self) -> bool:
        """Whether a long prompt may prefill in chunks, later chunks attending over the cached keys and values of the
        earlier ones: those must be in the model's dtype (not FP8 codes)."""
        return self.k_scale is None

    def scales(self, layer: int) -> dict:
        """The keyword arguments write_kv and decode_attention take for layer's scales (none for a plain cache)."""
        return {} if self.k_scale is None else dict(k_scale=self.k_scale[layer], v_scale=self.v_scale[layer])

    def prefill(self, i: int, q, k, v, out, start, past: int = 0) -> None:
        """Layer i of a prompt prefill: k, v (B, Hkv, T, D) written at `start` (int32 (B,) offsets), then causal
        attention of q over the prompts' own k and v (in the model's dtype, whatever the cache holds), or, with
        `past` positions already cached (a chunk of a longer prompt), over the cache's first past + T positions."""
        write_kv(k, v, self.k[i], self.v[i], start, **self.scales(i))
        if past:
            end = past + q.shape[2]
            attention(q, self.k[i][:, :, :end], self.v[i][:, :, :end], causal=True, out=out)
        else:
            attention(q, k, v, causal=True, out=out)

    def decode(self, i: int, q, k, v, out, positions) -> None:
        """Layer i of a decode step: each sequence's new k, v written at `positions` and its query attending over the
        cache up to them, in one kernel."""
        decode_attention(q, self.k[i], self.v[i], positions, new_k=k, new_v=v, length_offset=1, out=out,
                         **self.scales(i))


class LatentCache:
    """MLA's KV cache: each token's latent entry [c, k_pe] per layer, for B sequences of up to `capacity`
    positions, zeroed (decode attention multiplies whole tiles, unwritten slots included, by probabilities that
    are 0 there, and 0 x NaN from stale memory would be NaN)."""

    chunked_prefill = False       # a chunk's plain-form attention would expand every earlier latent

    def __init__(self, spec: LatentSpec, batch: int, capacity: int, arrays: Arrays, dtype: str = "auto"):
        check_kv_cache_dtype(dtype)
        if dtype != "auto":
            raise ValueError(f"DeepSeek-V2's latent cache is kept in the model's dtype (kv_cache_dtype {dtype!r})")
        g = spec.chunk
        self.entries = arrays.zeros((spec.layers, batch, capacity, spec.width), spec.dtype)
        self.chunks = self.entries.reshape(spec.layers, batch, capacity, spec.width // g, g)
        self.capacity, self.R, self.Rg = capacity, spec.rank, spec.rank // g

    def latent(self, layer: int):
        """(B, capacity, R) latents and (B, capacity, P) rotary keys of one layer (views)."""
        e = self.entries[layer]
        return e[:, :, :self.R], e[:, :, self.R:]

    def latent_chunks(self, layer: int):
        """The same as (B, R/g, capacity, g) and (B, P/g, capacity, g) heads (write_kv's layout)."""
        e = self.chunks[layer]
        return e[:, :, :self.Rg].transpose(0, 2, 1, 3), e[:, :, self.Rg:].transpose(0, 2, 1, 3)

    def write(self, i: int, c_chunks, pe_chunks, start) -> None:
        """Layer i's new latent entries of a prompt, as write_kv's heads, at `start` (int32 (B,) offsets)."""
        c, pe = self.latent_chunks(i)           # one array as keys and values: a row copy
        write_kv(c_chunks, c_chunks, c, c, start)
        write_kv(pe_chunks, pe_chunks, pe, pe, start)

    def decode(self, i: int, q_c, q_pe, new_c, new_pe, positions, scale: float, out) -> None:
        """Layer i of an absorbed MLA decode step: each sequence's new entry written at `positions`, its latent-space
        queries attending over its entries up to them."""
        c, pe = self.latent(i)
        mla_decode_attention(q_c, q_pe, c, pe, positions, scale=scale, new_c=new_c, new_pe=new_pe, length_offset=1,
                             out=out)


def new_cache(model, batch: int, capacity: int, arrays: Arrays, dtype: str = "auto"):
    """The static-batch cache of `model` (its cache_spec(); an FP8 one scaled by its kv_scales) for `batch` sequences
    of up to `capacity` positions."""
    spec = model.cache_spec()
    if isinstance(spec, LatentSpec):
        return LatentCache(spec, batch, capacity, arrays, dtype)
    return KVCache(spec, batch, capacity, arrays, dtype, model.kv_scales)

"""Continuous batching's paged KV caches, built from the cache a model asks for (models.base.KVSpec: per-head keys and
values, PagedKV; LatentSpec: DeepSeek-V2's latent entries, PagedLatents): the block pools of every layer, the
activations a pass of rows runs in, and the attention calls a decode pass and a prefill pass make through the pools
(tilekit.engine.paged's executor gives them its per-step inputs: block tables, lengths, write slots, query tiles).
Block 0 is never handed out: padded rows write there. The static batch's caches are tilekit.engine.kv_cache.
"""

from __future__ import annotations

import numpy as np

from tilekit.autotune.arrays import numpy_dtype
from tilekit.engine.kv_cache import check_kv_cache_dtype, fp8_scales
from tilekit.kernels import paged_decode_attention, paged_mla_decode_attention, paged_prefill_attention, paged_write_kv
from tilekit.models.base import Arrays, LatentSpec


def one_token_rows(x, start: int, n: int):
    """(n, H, 1, D) of tokens start .. start+n-1 of a (1, H, tokens, D) view: each token a sequence of one."""
    import cupy
    rows = x[0, :, start:start + n]
    s = rows.strides
    return cupy.lib.stride_tricks.as_strided(rows, (n, rows.shape[0], 1, rows.shape[2]), (s[1], s[0], s[1], s[2]))


def token_rows(x, start: int, n: int):
    """(n, H, D) rows of tokens start .. start+n-1 of a (1, H, tokens, D) view."""
    return x[0, :, start:start + n].transpose(1, 0, 2)


def paged_cache(model, block: int, kv_cache_dtype: str):
    """The paged cache `model` asks for (its cache_spec()), not yet allocated (see allocate)."""
    spec = model.cache_spec()
    check_kv_cache_dtype(kv_cache_dtype)
    if isinstance(spec, LatentSpec):
        return PagedLatents(spec, block, kv_cache_dtype)
    return PagedKV(spec, block, kv_cache_dtype, model.kv_scales)


class PagedKV:
    """Per-head keys and values: pools (layers, blocks, kv heads, BLOCK, head_dim) for keys and for values, in the
    model's dtype or FP8 codes with the static KVCache scales. A pass of n rows runs as one sequence of n tokens
    (model.activations(1, n)); a decode row is a sequence of one token of it."""

    def __init__(self, spec, block: int, kv_cache_dtype: str, kv_scales):
        self.spec, self.block, self.fp8, self.kv_scales = spec, block, kv_cache_dtype == "fp8", kv_scales
        self.codes = "uint8" if self.fp8 else spec.dtype
        s = spec
        self.block_bytes = 2 * s.layers * s.kv_heads * block * s.head_dim * np.dtype(numpy_dtype(self.codes)).itemsize

    def allocate(self, num_blocks: int, arrays: Arrays, prefill_rows: int, width: int) -> None:
        """The pools of num_blocks blocks, zeroed: decode attention multiplies whole key tiles, never-written slots
        included, by probabilities that are 0 there, and 0 x NaN from stale memory would be NaN."""
        import cupy
        s = self.spec
        shape = (s.layers, num_blocks, s.kv_heads, self.block, s.head_dim)
        self.k, self.v = arrays.zeros(shape, self.codes), arrays.zeros(shape, self.codes)
        self.scales = None
        if self.fp8:
            k, v = fp8_scales(self.kv_scales, s.layers, s.kv_heads)
            self.scales = (cupy.asarray(k), cupy.asarray(v))

    def activations(self, model, rows: int, arrays: Arrays):
        return model.activations(1, rows, arrays)

    def _scales(self, i: int) -> dict:
        return {} if self.scales is None else dict(k_scale=self.scales[0][i], v_scale=self.scales[1][i])

    def decode_attend(self, model, ex, R: int):
        """Rows 0 .. R-1 (slot s: its newest token): each writes its key and value and attends over its blocks."""
        v = ex.views

        def attend(i, q, k, vv, out):
            paged_decode_attention(one_token_rows(q, 0, R), self.k[i], self.v[i], ex.dtable[:R], v["lengths"][:R],
                                   new_k=one_token_rows(k, 0, R), new_v=one_token_rows(vv, 0, R), length_offset=1,
                                   out=one_token_rows(out, 0, R), **self._scales(i))
        return attend

    def prefill_attend(self, model, ex, P: int):
        """Prefill rows S .. S+P-1: their keys and values written into their slots, then each chunk's queries over
        its blocks (the query tiles)."""
        v, S = ex.views, ex.S

        def attend(i, q, k, vv, out):
            paged_write_kv(token_rows(k, 0, P), token_rows(vv, 0, P), self.k[i], self.v[i], v["slots"][S:S + P],
                           **self._scales(i))
            paged_prefill_attention(token_rows(q, 0, P), self.k[i], self.v[i], ex.ptable, ex.tiles,
                                    out=token_rows(out, 0, P), **self._scales(i))
        return attend


class _Through:
    """What a latent model's decode_attend calls its cache through: decode(i, q_c, q_pe, new_c, new_pe, positions,
    scale, out) (engine.kv_cache.LatentCache's signature)."""

    def __init__(self, decode):
        self.decode = decode


class PagedLatents:
    """MLA's latent entries: pools (layers, blocks, BLOCK, R) of latents and (layers, blocks, BLOCK, P) of rotary
    keys, in the model's dtype. Every row of a pass, a prefill token's too, runs as a sequence of one token
    (model.activations(n, 1)) in the absorbed form: a prompt chunk's entries are written first, then each of its
    tokens attends over its request's blocks up to its own position, so that a chunk with a cached past (a longer
    prompt's later chunk, a prefix hit) attends to it as a whole prompt does."""

    def __init__(self, spec, block: int, kv_cache_dtype: str):
        if kv_cache_dtype != "auto":
            raise ValueError(f"DeepSeek-V2's latent cache is kept in the model's dtype (kv_cache_dtype "
                             f"{kv_cache_dtype!r})")
        self.spec, self.block = spec, block
        self.block_bytes = spec.layers * block * spec.width * np.dtype(numpy_dtype(spec.dtype)).itemsize

    def allocate(self, num_blocks: int, arrays: Arrays, prefill_rows: int, width: int) -> None:
        """The pools of num_blocks blocks, zeroed (as PagedKV's), and each prefill row's block table."""
        s = self.spec
        self.c = arrays.zeros((s.layers, num_blocks, self.block, s.rank), s.dtype)
        self.pe = arrays.zeros((s.layers, num_blocks, self.block, s.width - s.rank), s.dtype)
        self.c_heads = [self.c[i][:, None] for i in range(s.layers)]      # as paged_write_kv's one head
        self.pe_heads = [self.pe[i][:, None] for i in range(s.layers)]
        self.row_table = arrays.zeros((prefill_rows, width), "int32")

    def activations(self, model, rows: int, arrays: Arrays):
        return model.activations(rows, 1, arrays)

    def decode_attend(self, model, ex, R: int):
        """Rows 0 .. R-1 (slot s: its newest token): each writes its entry and attends over its blocks."""
        v = ex.views

        def decode(i, q_c, q_pe, new_c, new_pe, positions, scale, out):
            paged_mla_decode_attention(q_c, q_pe, self.c[i], self.pe[i], ex.dtable[:R], v["lengths"][:R], scale=scale,
                                       new_c=new_c, new_pe=new_pe, length_offset=1, out=out)
        return model.decode_attend(_Through(decode), None)

    def prefill_attend(self, model, ex, P: int):
        """Prefill rows S .. S+P-1: the chunks' entries written into their slots, then each row over its request's
        blocks (its chunk's table row, ex.views["seqs"]) up to its own position."""
        import cupy
        v, S = ex.views, ex.S
        cupy.take(ex.ptable, v["seqs"][:P], axis=0, out=self.row_table[:P])
        slots, positions, table = v["slots"][S:S + P], v["positions"][S:S + P], self.row_table[:P]

        def decode(i, q_c, q_pe, new_c, new_pe, _positions, scale, out):
            paged_write_kv(new_c, new_c, self.c_heads[i], self.c_heads[i], slots)      # one array as keys and values
            paged_write_kv(new_pe, new_pe, self.pe_heads[i], self.pe_heads[i], slots)
            paged_mla_decode_attention(q_c, q_pe, self.c[i], self.pe[i], table, positions, scale=scale,
                                       length_offset=1, out=out)
        return model.decode_attend(_Through(decode), None)

"""Multi-head latent attention for decoding, in the absorbed form, over a latent KV cache.

DeepSeek-V2 caches per token one latent c (kv_lora_rank R wide, after its RMSNorm) and one shared rotary key
k_pe (qk_rope_head_dim P wide): 576 values for V2-Lite, not 2 x 16 heads x 128-192. With the key up-projection
absorbed into the query (q_c = q_nope @ W_UK per head, R wide, done by the model), head h's score for position
j is q_c[h] . c[j] + q_pe[h] . k_pe[j], and its output in latent space is sum_j p[h, j] c[j] (the model applies
W_UV and o_proj after). So one program serves a group of heads, stacked as rows of one query tile, and each
latent tile it loads is both the keys and the values of all of them: a step reads the latent cache once.

The rest is decode_attention's flash-decoding: the context is cut into CHUNK-long splits, each keeping a
partial softmax state that decode_attention's merge kernel combines (no merge with one split); lengths live on
the device, the grid depends only on the capacity, and given the new tokens' latents the split holding the last
position writes them into the cache and attends to them from registers.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec, absent
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.attention import LOG2E, batch_head, check_heads_out, heads_out
from tilekit.kernels.decode_attention import MAX_QUERIES, merge_splits
from tilekit.kernels.tiles import online_softmax_fold_key, online_softmax_step_by_column, sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO
MAX_LATENT = 1024
MAX_ROPE = 256


@ct.kernel
def mla_decode_kernel(Q, Qpe, Cnew, Pnew, C, Kpe, Lengths, O, Opart, Mpart, Lpart, qk_scale: float,
                      length_offset: int, HT: ct.Constant[int], NQ: ct.Constant[int],
                      BN: ct.Constant[int], R: ct.Constant[int], P: ct.Constant[int], GROUPS: ct.Constant[int],
                      CHUNK: ct.Constant[int], SPLITS: ct.Constant[int], NEW_KV: ct.Constant[bool]):
    """Attention of split bid(1) of (batch, head group) bid(0).

    Q: (B, H, nq, R) absorbed queries, Qpe: (B, H, nq, P) rotary queries; C: (B, capacity, R) latents, Kpe:
    (B, capacity, P) rotary keys; Lengths[b] + length_offset = valid positions, the last nq of which are the
    queries' own (causal among them). With NEW_KV those nq entries come from Cnew (B, nq, R), Pnew (B, nq, P):
    the split holding the last position folds them in first, one rank-1 update each, and writes them into C, Kpe.
    The query tile is group g's HT heads x NQ tokens (nq padded to a power of two), head-major, a column per
    query: the scores are (positions, queries) and the output (R, queries), so that the products' M axis is the
    positions and the latent (Hopper's asynchronous MMA, operands in shared memory). With the queries as rows (M =
    16, operands in registers) the kernel spilled 4.9 KB of registers a thread, and with the new tokens folded as
    an MMA tile 2 KB; none now (benchmarks/studies/local_memory.py). With SPLITS == 1 the program writes O (B, H,
    nq, R); otherwise its partial state goes to Opart (B, GROUPS, S, HT NQ, R), Mpart, Lpart (B, GROUPS, S, HT NQ)
    for mla_merge_kernel.
    """
    sync_with_previous_kernel()
    mla_split(Q, Qpe, Cnew, Pnew, C, Kpe, Lengths, Lengths, O, Opart, Mpart, Lpart, qk_scale, length_offset, HT, NQ, BN,
              R, P, GROUPS, CHUNK, SPLITS, NEW_KV, False)


@ct.function
def latent_tile(C, Kpe, Table, b, j, BN, R, P, PAGED):
    """Tile j (BN, R) of sequence b's latents and (BN, P) of its rotary keys: from C (B, capacity, R) and Kpe (B,
    capacity, P), or with PAGED from pools (blocks, BLOCK, R) and (blocks, BLOCK, P) whose block Table[b, p // BLOCK]
    holds position p (BN divides BLOCK: one load from one block)."""
    if PAGED:
        per_block = C.shape[1] // BN
        block = ct.load(Table, (b, j // per_block), shape=())
        c = ct.load(C, (block, j % per_block, 0), (1, BN, R), padding_mode=ZERO)
        k_pe = ct.load(Kpe, (block, j % per_block, 0), (1, BN, P), padding_mode=ZERO)
    else:
        c = ct.load(C, (b, j, 0), (1, BN, R), padding_mode=ZERO)
        k_pe = ct.load(Kpe, (b, j, 0), (1, BN, P), padding_mode=ZERO)
    return c.reshape((BN, R)), k_pe.reshape((BN, P))


@ct.function
def mla_split(Q, Qpe, Cnew, Pnew, C, Kpe, Table, Lengths, O, Opart, Mpart, Lpart, qk_scale, length_offset, HT, NQ, BN,
              R, P, GROUPS, CHUNK, SPLITS, NEW_KV, PAGED):
    """The body of mla_decode_kernel and paged_mla_decode_kernel (PAGED: C and Kpe are pools read and written
    through Table; the dense kernel passes Lengths in its place, never read). Its kernel has waited for the one
    before."""
    QP = HT * NQ
    b, g = batch_head(ct.bid(0), GROUPS)
    split = ct.bid(1)
    nq = Q.shape[2]
    length = ct.load(Lengths, (b,), shape=()) + length_offset
    first_new = length - nq
    start = split * CHUNK
    cached = length
    if NEW_KV:
        cached = first_new
    end = ct.minimum(cached, start + CHUNK)
    q_t = ct.transpose(ct.load(Q, (b, g, 0, 0), (1, HT, NQ, R), padding_mode=ZERO).reshape((QP, R)))
    q_pe_t = ct.transpose(ct.load(Qpe, (b, g, 0, 0), (1, HT, NQ, P), padding_mode=ZERO).reshape((QP, P)))
    q_pos = (ct.arange(QP, dtype=ct.int32) % NQ).reshape((1, QP)) + first_new
    m_i = ct.full((1, QP), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((1, QP), dtype=ct.float32)
    acc = ct.zeros((R, QP), dtype=ct.float32)
    if NEW_KV:
        if split == (length - 1) // CHUNK:
            for t in range(nq):          # each new token a rank-1 update: as an MMA tile, the fold spilled 2 KB
                c_t = ct.load(Cnew, (b, t, 0), (1, 1, R), padding_mode=ZERO)
                pe_t = ct.load(Pnew, (b, t, 0), (1, 1, P), padding_mode=ZERO)
                c_col = ct.transpose(c_t.reshape((1, R))).astype(ct.float32)                   # (R, 1)
                s_t = ct.sum(q_t.astype(ct.float32) * c_col, axis=0, keepdims=True)
                s_t = s_t + ct.sum(q_pe_t.astype(ct.float32) * ct.transpose(pe_t.reshape((1, P))).astype(ct.float32),
                                   axis=0, keepdims=True)
                s_t = ct.where(first_new + t <= q_pos, s_t * qk_scale, -math.inf)     # causal among the new
                m_i, l_i, acc = online_softmax_fold_key(s_t, m_i, l_i, acc, c_col)
                if PAGED:                        # its block of the pool, its slot there
                    pos = first_new + t
                    block = ct.load(Table, (b, pos // C.shape[1]), shape=())
                    ct.store(C, (block, pos % C.shape[1], 0), c_t)
                    ct.store(Kpe, (block, pos % C.shape[1], 0), pe_t)
                else:
                    ct.store(C, (b, first_new + t, 0), c_t)
                    ct.store(Kpe, (b, first_new + t, 0), pe_t)
    for j in range(start // BN, ct.cdiv(end, BN)):
        c, k_pe = latent_tile(C, Kpe, Table, b, j, BN, R, P, PAGED)
        s = ct.mma(c, q_t, ct.zeros((BN, QP), dtype=ct.float32))
        s = ct.mma(k_pe, q_pe_t, s) * qk_scale
        k_pos = (ct.arange(BN, dtype=ct.int32) + j * BN).reshape((BN, 1))
        s = ct.where((k_pos < end) & (k_pos <= q_pos), s, -math.inf)
        m_i, l_i, acc = online_softmax_step_by_column(s, m_i, l_i, acc, ct.transpose(c))
    if SPLITS == 1:
        ct.store(O, (b, g, 0, 0), ct.transpose(acc / l_i).astype(O.dtype).reshape((1, HT, NQ, R)))
    else:
        ct.store(Opart, (b, g, split, 0, 0), ct.transpose(acc).reshape((1, 1, 1, QP, R)))
        ct.store(Mpart, (b, g, split, 0), m_i.reshape((1, 1, 1, QP)))
        ct.store(Lpart, (b, g, split, 0), l_i.reshape((1, 1, 1, QP)))


@ct.kernel
def mla_merge_kernel(Opart, Mpart, Lpart, O, HT: ct.Constant[int], NQ: ct.Constant[int], R: ct.Constant[int]):
    """O[b, heads of group g] = the merge of the partial softmax states of every split of (batch, group) bid(0)."""
    sync_with_previous_kernel()
    b, g = batch_head(ct.bid(0), Mpart.shape[1])
    out = merge_splits(Opart, Mpart, Lpart, b, g, HT * NQ, R)
    ct.store(O, (b, g, 0, 0), out.astype(O.dtype).reshape((1, HT, NQ, R)))


def _groups(p: dict, c: dict) -> int:
    """Head groups: one program (per split) serves HP heads, or all of them in one group."""
    return ct.cdiv(p["H"], c["HP"])


def _head_tile(p: dict, c: dict) -> int:
    """Heads in the query tile: HP, or more where a single group's rows would be under 16 (past H: zeros)."""
    return max(c["HP"], 16 // pow2_ceil(p["nq"]))


def _qp(p: dict, c: dict) -> int:
    """Rows of the query tile: its heads x the new tokens (padded to a power of two)."""
    return _head_tile(p, c) * pow2_ceil(p["nq"])


def _heads_fit(p: dict, hp: int) -> bool:
    """Groups of exactly hp heads (tiles of the heads axis), at least 16 rows, or one group of every head; the fp32
    output tile within 64 KB of registers."""
    c, H = dict(HP=hp), p["H"]
    return hp <= pow2_ceil(H) and (hp >= H or (H % hp == 0 and hp * pow2_ceil(p["nq"]) >= 16)) \
        and _qp(p, c) <= 64 and _qp(p, c) * pow2_ceil(p["R"]) <= 16 * 1024


def _latent_tile_fits(p: dict, bn: int) -> bool:
    """A tile of bn latents and rotary keys within 80 KB."""
    item = 4 if p["dtype"] == "float32" else 2
    return bn * (pow2_ceil(p["R"]) + pow2_ceil(p["P"])) * item <= 80 * 1024


def _fits(c: dict, p: dict) -> bool:
    return (_heads_fit(p, c["HP"]) and _latent_tile_fits(p, c["BN"])
            and c["BN"] <= c["CHUNK"] <= max(64, pow2_ceil(p["capacity"]))
            and (c["occupancy"] == 1 or _qp(p, c) * pow2_ceil(p["R"]) <= 8 * 1024))


SPACE = SearchSpace(_fits, HP=(1, 2, 4, 8, 16, 32, 64), BN=(16, 32, 64, 128), CHUNK=(64, 128, 256, 512, 1024, 2048),
                    occupancy=(1, 2))


def default_config(p: dict) -> dict:
    """Every head in one group where the tile allows (the cache read once), the widest latent tile up to 64
    that fits, and splits for about two programs per SM of a 132-SM GPU, but at most 32 per (batch, group):
    one program merges a group's splits, reading R fp32 values per head and split."""
    hp = max(h for h in SPACE.params["HP"] if _heads_fit(p, h))
    bn = max(b for b in (16, 32, 64) if b == 16 or _latent_tile_fits(p, b))
    per_seq = min(32, max(1, 264 // max(1, p["B"] * ct.cdiv(p["H"], hp))))
    chunk = max(64, bn, pow2_ceil(math.ceil(p["capacity"] / per_seq)))
    return dict(HP=hp, BN=bn, CHUNK=min(2048, chunk), occupancy=1)


def _splits(p: dict, c: dict) -> int:
    return ct.cdiv(p["capacity"], c["CHUNK"])


def _arrays(p: dict) -> dict:
    B, H, nq, cap, R, P, dt = p["B"], p["H"], p["nq"], p["capacity"], p["R"], p["P"], p["dtype"]
    row = R + P            # queries: views of one (B, nq, H, R + P) buffer; latents: of one (B, capacity, R + P)
    queries = (nq * H * row, row, H * row, 1)
    cache = (cap * row, row, 1)
    new = {"c_new": ArraySpec(dt, (B, nq, R), (nq * row, row, 1)), "pe_new": ArraySpec(dt, (B, nq, P), (nq * row, row, 1))} \
        if p["new_kv"] else {"c_new": absent(dt, 3), "pe_new": absent(dt, 3)}
    return {"q": ArraySpec(dt, (B, H, nq, R), queries), "q_pe": ArraySpec(dt, (B, H, nq, P), queries), **new,
            "c": ArraySpec(dt, (B, cap, R), cache), "k_pe": ArraySpec(dt, (B, cap, P), cache),
            "lengths": ArraySpec("int32", (B,), fill=cap), "o": heads_out(dt, B, H, nq, R)}


def _scratch(p: dict, c: dict) -> dict:
    """Partial softmax states of the splits (none with one split)."""
    B, G, S, QP = p["B"], _groups(p, c), _splits(p, c), _qp(p, c)
    if S == 1:
        return {"opart": absent("float32", 5), "mpart": absent("float32", 4), "lpart": absent("float32", 4)}
    return {"opart": ArraySpec("float32", (B, G, S, QP, pow2_ceil(p["R"])), role="scratch"),
            "mpart": ArraySpec("float32", (B, G, S, QP), role="scratch"),
            "lpart": ArraySpec("float32", (B, G, S, QP), role="scratch")}


def _grid(p: dict, c: dict) -> tuple:
    return (p["B"] * _groups(p, c), _splits(p, c), 1)


def _merge_grid(p: dict, c: dict) -> tuple:
    """No merge launch with one split."""
    return (p["B"] * _groups(p, c) if _splits(p, c) > 1 else 0, 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    nqp = pow2_ceil(p["nq"])
    return (_head_tile(p, c), nqp, c["BN"], pow2_ceil(p["R"]), pow2_ceil(p["P"]), _groups(p, c),
            c["CHUNK"], _splits(p, c), bool(p["new_kv"]))


def _merge_constants(p: dict, c: dict) -> tuple:
    return (_head_tile(p, c), pow2_ceil(p["nq"]), pow2_ceil(p["R"]))


def _check_4d(a, name: str, like, shape: tuple) -> None:
    arrays.check_same("q", like, name, a)
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    arrays.check_last_contiguous(a, name)


def check_latent_queries(q, q_pe, op: str) -> tuple:
    """(B, H, nq, R, P) of absorbed queries q (B, H, nq, R) and rotary queries q_pe (B, H, nq, P) that `op` takes."""
    arrays.check_dtype(q, "q", arrays.FLOAT_DTYPES)
    if len(q.shape) != 4 or len(q_pe.shape) != 4:
        raise ValueError(f"q and q_pe must be 4-D (batch, heads, tokens, dim), got shapes {q.shape}, {q_pe.shape}")
    B, H, nq, R = q.shape
    P = q_pe.shape[3]
    if not (1 <= R <= MAX_LATENT and 1 <= P <= MAX_ROPE):
        raise ValueError(f"latent width {R} and rotary width {P} must lie in 1..{MAX_LATENT} and 1..{MAX_ROPE}")
    if not 1 <= nq <= MAX_QUERIES:
        raise ValueError(f"q holds {nq} query tokens per sequence; {op} takes 1..{MAX_QUERIES}")
    arrays.check_last_contiguous(q, "q")
    _check_4d(q_pe, "q_pe", q, (B, H, nq, P))
    return B, H, nq, R, P


def check_new_entries(c_new, pe_new, q, views: dict, at: int) -> None:
    """The new entries' latents c_new (B, nq, R) and rotary keys pe_new (B, nq, P), both or neither; given, they are
    the op's arguments at and at + 1 (views)."""
    B, H, nq, R = q.shape
    if (c_new is None) != (pe_new is None):
        raise ValueError("pass both new_c and new_pe, or neither")
    if c_new is not None:
        _check_4d(c_new, "new_c", q, (B, nq, R))
        _check_4d(pe_new, "new_pe", q, (B, nq, pe_new.shape[-1]))
        views.update(c_new=(at, None), pe_new=(at + 1, None))


def _bind(a: list, flags: tuple) -> Binding:
    q, q_pe, c_cache, pe_cache, lengths, c_new, pe_new, out = a
    B, H, nq, R, P = check_latent_queries(q, q_pe, "mla_decode_attention")
    if len(c_cache.shape) != 3 or c_cache.shape[0] != B or c_cache.shape[2] != R or c_cache.shape[1] < 1:
        raise ValueError(f"c_cache must be ({B}, capacity, {R}), got shape {c_cache.shape}")
    cap = c_cache.shape[1]
    _check_4d(c_cache, "c_cache", q, (B, cap, R))
    _check_4d(pe_cache, "pe_cache", q, (B, cap, P))
    arrays.check_dtype(lengths, "lengths", ("int32",))
    if lengths.shape != (B,) or lengths.device != q.device:
        raise ValueError(f"lengths must be an int32 array of shape ({B},) on GPU {q.device}, "
                         f"got shape {lengths.shape} on GPU {lengths.device}")
    views = {"q": (0, None), "q_pe": (1, None), "c": (2, None), "k_pe": (3, None), "lengths": (4, None),
             "o": (7, None)}
    check_new_entries(c_new, pe_new, q, views, 5)
    if out is not None:
        check_heads_out(out, q)
    return Binding(problem=dict(dtype=q.dtype, B=B, H=H, nq=nq, capacity=cap, R=R, P=P,
                                new_kv=int(c_new is not None)),
                   arrays=views, output=(7, arrays.allocator(q.kind, q.device, (B, nq, H, R), q.dtype, (0, 2, 1, 3))),
                   returns=7, scalars={"qk_scale": (0, None), "length_offset": (1, 0)})


MLA_DECODE_ATTENTION = Op(
    "mla_decode_attention", args=("q", "q_pe", "c_cache", "pe_cache", "lengths", "new_c", "new_pe", "out"),
    optional=("new_c", "new_pe", "out"),
    key=dict(dtype=None, B=pow2_bucket, H=None, nq=None, capacity=pow2_bucket, R=None, P=None, new_kv=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch,
    scalars=lambda p: {"qk_scale": LOG2E / math.sqrt(192), "length_offset": 0},
    launches=(Launch(mla_decode_kernel, _grid,
                     ("q", "q_pe", "c_new", "pe_new", "c", "k_pe", "lengths", "o", "opart", "mpart", "lpart",
                      "qk_scale", "length_offset"), _constants,
                     dependent=False),       # one ordinary launch per layer, as decode_attention (see there)
              Launch(mla_merge_kernel, _merge_grid, ("opart", "mpart", "lpart", "o"), _merge_constants,
                     hinted=False)),
    bind=_bind, choices=dict(new_kv=(0, 1)), cli_defaults=dict(nq=1, new_kv=1))


def mla_decode_attention(q, q_pe, c_cache, pe_cache, lengths, *, scale: float, new_c=None, new_pe=None,
                         length_offset: int = 0, out=None):
    """Absorbed multi-head latent attention of nq new queries per sequence against a latent KV cache.

    q: (B, H, nq, R) queries absorbed into the latent space (q_nope @ W_UK per head); q_pe: (B, H, nq, P)
    rotary queries; c_cache: (B, capacity, R) latents and pe_cache: (B, capacity, P) rotary keys (typically
    views of one (B, capacity, R + P) cache); lengths: int32 (B,) on the device. Sequence b attends to its first
    n = lengths[b] + length_offset positions, the last nq of which are the queries' own (causal among them);
    n must lie in nq .. capacity. scores = (q . c + q_pe . k_pe) * scale. new_c (B, nq, R), new_pe (B, nq, P),
    when given, are those nq positions' entries: written into the caches at n - nq .. n - 1 in the same launch.
    Returns the latent outputs sum_j p_j c_j, (B, H, nq, R) of q's kind (a view of a (B, nq, H, R) buffer).
    """
    if not isinstance(length_offset, (int, np.integer)) or isinstance(length_offset, bool):
        raise TypeError(f"length_offset must be an int, got {type(length_offset).__name__}")
    return MLA_DECODE_ATTENTION((q, q_pe, c_cache, pe_cache, lengths, new_c, new_pe, out), (),
                                (arrays.checked_positive(scale, "scale") * LOG2E, int(length_offset)))


def mla_decode_attention_reference(q, q_pe, c_cache, pe_cache, lengths, *, scale: float, new_c=None, new_pe=None,
                                   length_offset: int = 0) -> np.ndarray:
    """float64 absorbed MLA decode: per sequence, softmax((q c^T + q_pe k_pe^T) * scale) c over its first
    lengths[b] + offset positions (causal among the last nq), the last nq replaced by new_c, new_pe when given."""
    q, q_pe = np.asarray(q, np.float64), np.asarray(q_pe, np.float64)
    c_cache, pe_cache = np.array(c_cache, np.float64), np.array(pe_cache, np.float64)
    nq = q.shape[2]
    out = np.empty(q.shape)
    for b, n in enumerate(np.asarray(lengths) + length_offset):
        if new_c is not None:
            c_cache[b, n - nq:n] = np.asarray(new_c, np.float64)[b]
            pe_cache[b, n - nq:n] = np.asarray(new_pe, np.float64)[b]
        c, pe = c_cache[b, :n], pe_cache[b, :n]
        s = (q[b] @ c.T + q_pe[b] @ pe.T) * scale                           # (H, nq, n)
        s = np.where(np.arange(n)[None, :] <= np.arange(nq)[:, None] + n - nq, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = (p / p.sum(-1, keepdims=True)) @ c
    return out


if __name__ == "__main__":
    from tilekit.kernels.mla_decode_attention import mla_decode_attention, mla_decode_attention_reference  # the op
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    for B, H, nq, cap, R, P, dtype, new in [(1, 16, 1, 4096, 512, 64, "bfloat16", True),
                                            (3, 16, 2, 700, 512, 64, "bfloat16", False),
                                            (2, 4, 3, 100, 32, 16, "float32", True)]:
        qq, cache = rand((B, nq, H, R + P), dtype), rand((B, cap, R + P), dtype)
        q, q_pe = qq[..., :R].transpose(0, 2, 1, 3), qq[..., R:].transpose(0, 2, 1, 3)
        kv_new = rand((B, nq, R + P), dtype) if new else None
        kw = dict(new_c=kv_new[..., :R], new_pe=kv_new[..., R:]) if new else {}
        lengths = np.random.default_rng(0).integers(nq, cap + 1, B).astype(np.int32)
        ref = mla_decode_attention_reference(host(q), host(q_pe), host(cache[..., :R]), host(cache[..., R:]), lengths,
                                             scale=0.1, **{k: host(v) for k, v in kw.items()})
        out = mla_decode_attention(q, q_pe, cache[..., :R], cache[..., R:], cupy.asarray(lengths), scale=0.1, **kw,
                                   out=poisoned((B, nq, H, R), dtype).transpose(0, 2, 1, 3))
        err = assert_close(host(out), ref, TOL[dtype], f"mla_decode_attention B{B} cap{cap} {dtype}")
        print(f"mla_decode_attention B{B} H{H} nq{nq} capacity {cap} R{R} P{P} {dtype} new={new}: ok, "
              f"relative error {err:.2e}")

"""Next-token choice on the GPU for every row of a batch: greedy or sampled, with the logit processing
of Hugging Face's generate, and the decode bookkeeping; graph-capturable (nothing goes to the host).

Per row, in this order (Hugging Face's, with presence/frequency penalties as in vLLM and OpenAI):
repetition penalty over every token seen (prompt and output: a positive logit is divided by it, a
negative one multiplied), presence and frequency penalties over the output tokens, the end-of-sequence
ids banned while fewer than min_new_tokens were generated, then for sampled rows temperature, top-k
(scores >= the k-th largest; ties kept), top-p (tokens whose strictly larger mass, renormalised after
top-k, is < top_p; ties kept together, where HF's sort would split them) and min-p (p >= min_p *
p_max). Greedy rows (temperature 0) take the first argmax of the penalised logits.

Sampling is the Gumbel-max trick with counter-based noise, hash(seed of the row, position, round,
token): the same seed gives the same tokens, run to run and graph or eager. The uniform draws have 23
bits, so a token more than ~19 nats below the best never wins (its probability is below 6e-9).

Three kernels, no sort. `scan` (batch x vocabulary chunks) processes the logits and keeps per chunk
the max and sum of exp; for a top-k row it finds a bound of the chunk's scores with between k and KS
(candidate_slots: a power of two a little above k) scores above it (a few bisection passes on the score; at the latest the chunk's own k-th
largest) and copies those scores into fixed candidate slots: every token of the global top-k is above
the largest of these bounds, and every score above it is a candidate. For any other row it keeps the
chunk's Gumbel-max draw. `check` (only when a row has top-p without top-k) sums the mass above that
row's draw. `finish` (one program per row) resolves a top-k row exactly from its candidates (at most
TILE_SLOTS of them where the vocabulary allows): the k-th score by the same bisection, min-p, then a
Gumbel-max draw among the kept candidates, with top-p by rejection; it accepts or rejects a top-p /
min-p row's draw (rejection: the kept set is an upper set, so the next draw is from the scores above
the rejected one, which leaves the distribution exact), and writes the token. Rare cases (a chunk's
candidates overflow their slots, as ties may make them; a rejected draw) run exactly over the whole row
in that program. Greedy rows do none of the sampling work.
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
from tilekit.kernels.tiles import sync_with_previous_kernel

NEG_INF = ct.PaddingMode.NEG_INF
ZERO = ct.PaddingMode.ZERO
INT_MIN = -(1 << 31)
INT_MAX = (1 << 31) - 1
MAX_ROUNDS = 4096        # rejection rounds of one row (each removes at least one token; never reached)
FLOAT_PARAMS = 6         # inverse temperature, top_p, log(min_p), repetition, presence, frequency
INT_PARAMS = 4           # sample (0: greedy), top_k (0: off), eos banned below this position, seed
MAX_EOS = 32
MAX_SLOTS = 256          # candidate slots per chunk: top_k up to this stays on the fast path
TILE_SLOTS = 2048        # candidate slots of a row (chunks x slots per chunk), where the vocabulary allows


@ct.function
def _fmix(h):
    """Murmur3's 32-bit finaliser: a bijection that mixes every bit of uint32 h into every other."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@ct.function
def _stream(seed, pos, rnd):
    """uint32 key of the noise of one row at one position and rejection round."""
    s = _fmix(seed.astype(ct.uint32) ^ 0x5BD1E995)
    return _fmix(s ^ (pos.astype(ct.uint32) * 0x9E3779B1 + rnd.astype(ct.uint32) * 0x7FEB352D))


@ct.function
def _gumbel(idx, stream):
    """Gumbel(0, 1) noise of the tokens idx (int32 tile) in one stream: -log(-log(u)), u of 23 bits
    (exact in float32, never 0 or 1)."""
    h = _fmix(_fmix(idx.astype(ct.uint32) * 0x9E3779B1 + stream) ^ stream)
    u = ((h >> 9).astype(ct.float32) + 0.5) * (1.0 / 8388608.0)
    return -ct.log(-ct.log(u))


@ct.function
def _key(z):
    """int32 keys that order as the float32 scores z do."""
    bits = ct.bitcast(z, ct.int32)
    return ct.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@ct.function
def _scores(Logits, Seen, Out, Eos, b, t, T, rep, pres, freq, inv_t, banned, E, PEN):
    """Processed scores of tokens t*T .. t*T+T-1 of row b as a (1, T) fp32 tile (-inf past the vocabulary):
    penalties, banned end-of-sequence ids, temperature."""
    x = ct.load(Logits, (b, t), (1, T), padding_mode=NEG_INF).astype(ct.float32)
    if PEN:
        seen = ct.load(Seen, (b, t), (1, T), padding_mode=ZERO)
        out = ct.load(Out, (b, t), (1, T), padding_mode=ZERO).astype(ct.float32)
        x = ct.where(seen > 0, ct.where(x < 0, x * rep, x / rep), x)
        x = x - pres * ct.where(out > 0, 1.0, 0.0) - freq * out
    if banned:
        # one id at a time: an (E, T) comparison tile takes tileiras minutes to compile at E=32, T=8192
        idx = t * T + ct.arange(T, dtype=ct.int32).reshape((1, T))
        for e in range(E):
            x = ct.where(idx == ct.gather(Eos, e, padding_value=-1), -math.inf, x)
    return x * inv_t


@ct.function
def _row_params(FP, IP, Positions, b):
    """The row's parameters (see FLOAT_PARAMS, INT_PARAMS) and its newest position."""
    return (ct.gather(FP, (b, 0)), ct.gather(FP, (b, 1)), ct.gather(FP, (b, 2)), ct.gather(FP, (b, 3)),
            ct.gather(FP, (b, 4)), ct.gather(FP, (b, 5)), ct.gather(IP, (b, 0)), ct.gather(IP, (b, 1)),
            ct.gather(IP, (b, 2)), ct.gather(IP, (b, 3)), ct.gather(Positions, b))


@ct.kernel
def next_token_scan_kernel(Logits, Seen, Out, Eos, FP, IP, Positions, CMax, CSum, CBestY, CBestZ, CBestI,
                           CCount, CKey, CandZ, CandI, CH: ct.Constant[int], KS: ct.Constant[int],
                           E: ct.Constant[int], PEN: ct.Constant[bool]):
    """Chunk ct.bid(1) of row ct.bid(0): max and sum of exp of its scores; for a top-k row a key with between
    k and KS of its scores >= it (_select; INT_MIN when fewer than k are valid) and those scores in slots
    [c*KS, c*KS + KS); else its Gumbel-max draw."""
    sync_with_previous_kernel()
    b = ct.bid(0)
    c = ct.bid(1)
    inv_t, top_p, log_min_p, rep, pres, freq, sample, top_k, eos_from, seed, pos = _row_params(FP, IP, Positions, b)
    z = _scores(Logits, Seen, Out, Eos, b, c, CH, rep, pres, freq, inv_t, pos < eos_from, E, PEN)
    m = ct.max(z)
    ct.scatter(CMax, (b, c), m)
    ct.scatter(CSum, (b, c), ct.sum(ct.exp(z - ct.where(m == -math.inf, 0.0, m))))
    idx = c * CH + ct.arange(CH, dtype=ct.int32).reshape((1, CH))
    if KS > 0 and (sample != 0) & (top_k > 0):
        key = _key(z)
        valid = (idx < Logits.shape[1]) & (z > -math.inf)
        kth = _select(Logits, Seen, Out, Eos, (z, key, idx, valid, z), b, m, rep, pres, freq, inv_t, False, top_k,
                      KS, 1, CH, E, PEN, False)
        keep = valid & (key >= kth)
        kept = ct.where(keep, 1, 0)
        rank = ct.cumsum(kept, axis=1) - 1
        slot = c * KS + rank
        into = keep & (rank < KS)
        ct.scatter(CandZ, (b, slot), z, mask=into)
        ct.scatter(CandI, (b, slot), idx, mask=into)
        ct.scatter(CCount, (b, c), ct.sum(kept))
        ct.scatter(CKey, (b, c), kth)
    else:
        y = z
        if sample != 0:
            y = z + _gumbel(idx, _stream(seed, pos, ct.full((), 0, ct.uint32)))
        best = ct.max(y)
        j = ct.argmax(y).astype(ct.int32)
        at = ct.arange(CH, dtype=ct.int32).reshape((1, CH)) == j
        ct.scatter(CBestY, (b, c), best)
        ct.scatter(CBestZ, (b, c), ct.max(ct.where(at, z, -math.inf)))
        ct.scatter(CBestI, (b, c), c * CH + j)


@ct.function
def _row_max(CMax, CSum, b, SP):
    """The row's max score M and sum of exp(score - M) from its chunks."""
    cmax = ct.load(CMax, (b, 0), (1, SP), padding_mode=NEG_INF)
    M = ct.max(cmax)
    Z = ct.sum(ct.load(CSum, (b, 0), (1, SP), padding_mode=ZERO) * ct.exp(cmax - M))
    return M, Z


@ct.function
def _best_draw(CBestY, CBestZ, CBestI, b, SP):
    """(token, its score) of the row's best Gumbel key over its chunks (the first chunk on ties)."""
    j = ct.argmax(ct.load(CBestY, (b, 0), (1, SP), padding_mode=NEG_INF))
    return ct.gather(CBestI, (b, j)), ct.gather(CBestZ, (b, j))


@ct.kernel
def next_token_check_kernel(Logits, Seen, Out, Eos, FP, IP, Positions, CMax, CSum, CBestY, CBestZ, CBestI, CMass,
                            CH: ct.Constant[int], SP: ct.Constant[int], E: ct.Constant[int],
                            PEN: ct.Constant[bool]):
    """For a row with top-p and no top-k: chunk ct.bid(1)'s mass of scores above the row's draw."""
    sync_with_previous_kernel()
    b = ct.bid(0)
    c = ct.bid(1)
    inv_t, top_p, log_min_p, rep, pres, freq, sample, top_k, eos_from, seed, pos = _row_params(FP, IP, Positions, b)
    if (sample != 0) & (top_k == 0) & (top_p < 1.0):
        M, Z = _row_max(CMax, CSum, b, SP)
        token, zx = _best_draw(CBestY, CBestZ, CBestI, b, SP)
        z = _scores(Logits, Seen, Out, Eos, b, c, CH, rep, pres, freq, inv_t, pos < eos_from, E, PEN)
        ct.scatter(CMass, (b, c), ct.sum(ct.where(z > zx, ct.exp(z - M), 0.0)))


@ct.function
def _first_max(y, idx):
    """(max of y, the smallest of idx where y attains it) of two (1, T) tiles."""
    best = ct.max(y)
    return best, ct.min(ct.where(y == best, idx, INT_MAX))


@ct.function
def _candidates(CandZ, CandI, CCount, b, lower, M, SP: ct.Constant[int], KS: ct.Constant[int]):
    """The row's top-k candidates as one tile: (scores, keys, tokens, valid, exp(score - M)); a slot is valid
    when it holds a candidate whose key is >= `lower`."""
    z = ct.load(CandZ, (b, 0), (1, SP * KS), padding_mode=NEG_INF)
    idx = ct.load(CandI, (b, 0), (1, SP * KS), padding_mode=ZERO)
    slot = ct.arange(SP * KS, dtype=ct.int32).reshape((1, SP * KS))
    key = _key(z)
    valid = (slot % KS < ct.gather(CCount, (b, slot // KS), padding_value=0)) & (key >= lower)
    return z, key, idx, valid, ct.where(valid, ct.exp(z - M), 0.0)


@ct.function
def _tile(Logits, Seen, Out, Eos, cand, b, t, M, rep, pres, freq, inv_t, banned, CH: ct.Constant[int],
          E: ct.Constant[int], PEN: ct.Constant[bool], FULL: ct.Constant[bool]):
    """(scores, keys, tokens, valid, exp(score - M)) of the row's t-th tile: the whole row's tokens in CH-wide
    tiles (FULL), or `cand`, its one tile of top-k candidates (_candidates), as it is."""
    if FULL:
        z = _scores(Logits, Seen, Out, Eos, b, t, CH, rep, pres, freq, inv_t, banned, E, PEN)
        idx = t * CH + ct.arange(CH, dtype=ct.int32).reshape((1, CH))
        valid = (idx < Logits.shape[1]) & (z > -math.inf)
        return z, _key(z), idx, valid, ct.where(valid, ct.exp(z - M), 0.0)
    return cand


@ct.function
def _value(key):
    """The float32 score whose _key is key."""
    return ct.bitcast(ct.where(key < 0, key ^ 0x7FFFFFFF, key), ct.float32)


@ct.function
def _select(Logits, Seen, Out, Eos, cand, b, M, rep, pres, freq, inv_t, banned, k, W, NT, CH: ct.Constant[int],
            E: ct.Constant[int], PEN: ct.Constant[bool], FULL: ct.Constant[bool]):
    """A key t of the row's NT tiles (see _tile) with k <= (valid keys >= t) <= W, or else the k-th largest
    valid key; INT_MIN when fewer than k are valid; the smallest valid key when k > W (no such t exists).

    Bisection on the score between lo, a valid key with at least k keys >= it, and hi, a bound with fewer
    than k: each pass counts the keys >= the midpoint, then snaps lo up to the smallest key above the
    midpoint or moves hi down to it, and stops once the count lies in [k, W]. The interval shrinks every
    pass, so it ends, at the latest, at the exact k-th largest key; with W = k it always returns that key."""
    n = ct.full((), 0, ct.int32)
    lo = ct.full((), INT_MAX, ct.int32)
    hi = ct.full((), INT_MIN, ct.int32)
    for t in range(NT):
        z, key, idx, valid, e = _tile(Logits, Seen, Out, Eos, cand, b, t, M, rep, pres, freq, inv_t, banned,
                                      CH, E, PEN, FULL)
        n = n + ct.sum(ct.where(valid, 1, 0))
        lo = ct.minimum(lo, ct.min(ct.where(valid, key, INT_MAX)))
        hi = ct.maximum(hi, ct.max(ct.where(valid, key, INT_MIN)) + 1)
    go = (n >= k) & (k <= W)
    lo = ct.where(n >= k, lo, INT_MIN)
    while go & (lo + 1 < hi):
        middle = _key(0.5 * _value(lo) + 0.5 * _value(hi - 1))
        mid = ct.minimum(ct.maximum(middle, lo + 1), hi - 1)
        count = ct.full((), 0, ct.int32)
        above = ct.full((), INT_MAX, ct.int32)
        for t in range(NT):
            z, key, idx, valid, e = _tile(Logits, Seen, Out, Eos, cand, b, t, M, rep, pres, freq, inv_t, banned,
                                          CH, E, PEN, FULL)
            up = valid & (key >= mid)
            count = count + ct.sum(ct.where(up, 1, 0))
            above = ct.minimum(above, ct.min(ct.where(up, key, INT_MAX)))
        ok = count >= k
        lo = ct.where(ok, above, lo)
        hi = ct.where(ok, ct.where(count <= W, above + 1, hi), mid)
    return lo


@ct.function
def _kept_draw(Logits, Seen, Out, Eos, cand, b, M, top_k, top_p, log_min_p, seed, pos, rep, pres, freq, inv_t,
               banned, NT, CH: ct.Constant[int], E: ct.Constant[int], PEN: ct.Constant[bool],
               FULL: ct.Constant[bool]):
    """Exact top-k / top-p / min-p of a row over its NT tiles (see _tile), then the Gumbel-max draw among the
    kept tokens: returns the token. Top-k and min-p are one key bound; top-p by rejection: a draw from the
    tokens above the bound is kept when the mass strictly above it is < top_p of the top-k mass, else the
    next round draws from the keys above it (the kept set is an upper set: the result stays exact)."""
    kth = _select(Logits, Seen, Out, Eos, cand, b, M, rep, pres, freq, inv_t, banned, top_k, top_k, NT, CH, E, PEN,
                  FULL)
    mass = ct.full((), 0.0, ct.float32)
    if top_p < 1.0:
        for t in range(NT):
            z, key, idx, valid, e = _tile(Logits, Seen, Out, Eos, cand, b, t, M, rep, pres, freq, inv_t, banned,
                                          CH, E, PEN, FULL)
            mass = mass + ct.sum(ct.where(key >= kth, e, 0.0))
    cut = ct.maximum(kth, _key(M + log_min_p))
    token = ct.full((), 0, ct.int32)
    rejected = ct.full((), 1, ct.int32)
    rnd = ct.full((), 0, ct.int32)
    while (rejected != 0) & (rnd < MAX_ROUNDS):
        stream = _stream(seed, pos, rnd.astype(ct.uint32))
        best_y = ct.full((), -math.inf, ct.float32)
        best_key = ct.full((), INT_MIN, ct.int32)
        for t in range(NT):
            z, key, idx, valid, e = _tile(Logits, Seen, Out, Eos, cand, b, t, M, rep, pres, freq, inv_t, banned,
                                          CH, E, PEN, FULL)
            y = ct.where(valid & (key >= cut), z + _gumbel(idx, stream), -math.inf)
            best, first = _first_max(y, idx)
            better = best > best_y
            token = ct.where(better, first, token)
            best_key = ct.where(better, ct.max(ct.where((idx == first) & (y == best), key, INT_MIN)), best_key)
            best_y = ct.where(better, best, best_y)
        above = ct.full((), 0.0, ct.float32)
        if top_p < 1.0:
            for t in range(NT):
                z, key, idx, valid, e = _tile(Logits, Seen, Out, Eos, cand, b, t, M, rep, pres, freq, inv_t, banned,
                                              CH, E, PEN, FULL)
                above = above + ct.sum(ct.where(key > best_key, e, 0.0))
        rejected = ct.where((top_p >= 1.0) | (above < top_p * mass), 0, 1)
        cut = best_key + 1
        rnd = rnd + 1
    return token


@ct.kernel
def next_token_finish_kernel(Logits, Seen, Out, Eos, FP, IP, Positions, CMax, CSum, CBestY, CBestZ, CBestI,
                             CCount, CKey, CandZ, CandI, CMass, Tokens, History, Finished, pad: int,
                             CH: ct.Constant[int], SP: ct.Constant[int], KS: ct.Constant[int],
                             E: ct.Constant[int], PEN: ct.Constant[bool], CHECK: ct.Constant[bool]):
    """Row ct.bid(0): choose its token, then Tokens[b] = token (pad once the row had finished),
    History[b, pos + 1] = token, Positions[b] += 1, Finished[b] |= token is an eos id, and with
    penalties Seen[b, token] and Out[b, token] += 1."""
    sync_with_previous_kernel()
    b = ct.bid(0)
    inv_t, top_p, log_min_p, rep, pres, freq, sample, top_k, eos_from, seed, pos = _row_params(FP, IP, Positions, b)
    banned = pos < eos_from
    NT = ct.cdiv(Logits.shape[1], CH)
    M, Z = _row_max(CMax, CSum, b, SP)
    token = ct.full((), 0, ct.int32)
    if KS > 0 and (sample != 0) & (top_k > 0):
        counts = ct.load(CCount, (b, 0), (1, SP), padding_mode=ZERO)
        chunk = ct.arange(SP, dtype=ct.int32).reshape((1, SP))
        lower = ct.max(ct.where(chunk < NT, ct.load(CKey, (b, 0), (1, SP), padding_mode=ZERO), INT_MIN))
        cand = _candidates(CandZ, CandI, CCount, b, lower, M, SP, KS)     # loaded once, reused by every pass
        if ct.max(counts) <= KS:
            token = _kept_draw(Logits, Seen, Out, Eos, cand, b, M, top_k, top_p, log_min_p, seed, pos, rep, pres,
                               freq, inv_t, banned, 1, CH, E, PEN, False)
        else:
            token = _kept_draw(Logits, Seen, Out, Eos, cand, b, M, top_k, top_p, log_min_p, seed, pos, rep, pres,
                               freq, inv_t, banned, NT, CH, E, PEN, True)
    else:
        token, zx = _best_draw(CBestY, CBestZ, CBestI, b, SP)
        if sample != 0:
            ok = zx >= M + log_min_p
            if CHECK:
                ok = ok & ((top_p >= 1.0) | (ct.sum(ct.load(CMass, (b, 0), (1, SP), padding_mode=ZERO)) < top_p * Z))
            rejected = ct.where(ok, 0, 1)
            rnd = ct.full((), 1, ct.int32)
            while (rejected != 0) & (rnd < MAX_ROUNDS):
                # the kept set lies above the rejected draw: draw again from the scores above it
                stream = _stream(seed, pos, rnd.astype(ct.uint32))
                best_y = ct.full((), -math.inf, ct.float32)
                best_z = ct.full((), -math.inf, ct.float32)
                for t in range(NT):
                    z = _scores(Logits, Seen, Out, Eos, b, t, CH, rep, pres, freq, inv_t, banned, E, PEN)
                    idx = t * CH + ct.arange(CH, dtype=ct.int32).reshape((1, CH))
                    y = ct.where(z > zx, z + _gumbel(idx, stream), -math.inf)
                    best, first = _first_max(y, idx)
                    better = best > best_y
                    token = ct.where(better, first, token)
                    best_z = ct.where(better, ct.max(ct.where(idx == first, z, -math.inf)), best_z)
                    best_y = ct.where(better, best, best_y)
                zx = best_z
                above = ct.full((), 0.0, ct.float32)
                for t in range(NT):
                    z = _scores(Logits, Seen, Out, Eos, b, t, CH, rep, pres, freq, inv_t, banned, E, PEN)
                    above = above + ct.sum(ct.where(z > zx, ct.exp(z - M), 0.0))
                rejected = ct.where((zx >= M + log_min_p) & ((top_p >= 1.0) | (above < top_p * Z)), 0, 1)
                rnd = rnd + 1
    done = ct.gather(Finished, b)
    token = ct.where(done != 0, pad, token)
    ct.scatter(Tokens, b, token)
    ct.scatter(History, (b, pos + 1), token)
    ct.scatter(Positions, b, pos + 1)
    eos = ct.gather(Eos, ct.arange(E, dtype=ct.int32), padding_value=-1)     # E is a power of two >= the ids
    ct.scatter(Finished, b, ct.where(ct.max(ct.where(eos == token, 1, 0)) > 0, 1, done))
    if PEN and (done == 0):
        ct.scatter(Seen, (b, token), ct.gather(Seen, (b, token)) + 1)
        ct.scatter(Out, (b, token), ct.gather(Out, (b, token)) + 1)


# -- the op -------------------------------------------------------------------------------------------


def _chunks(p: dict, c: dict) -> int:
    return -(-p["V"] // c["CH"])


def _fits(c: dict, p: dict) -> bool:
    """Chunks no wider than the vocabulary, at most 256 of them, and a candidate tile (chunks x KS) of at
    most TILE_SLOTS, or of the fewest slots any chunk width gives."""
    fewest = pow2_ceil(-(-p["V"] // CHUNKS[-1])) * p["KS"]
    return c["CH"] <= max(CHUNKS[0], pow2_ceil(p["V"])) and _chunks(p, c) <= 256 \
        and pow2_ceil(_chunks(p, c)) * p["KS"] <= max(TILE_SLOTS, fewest)


CHUNKS = (1024, 2048, 4096, 8192)


SPACE = SearchSpace(_fits, CH=CHUNKS, occupancy=(1, 2, 4))


def default_config(p: dict) -> dict:
    for ch in (2048, 4096, 8192, 1024):
        c = dict(CH=ch, occupancy=2)
        if _fits(c, p):
            return c
    return dict(CH=8192, occupancy=1)


def _bench_rows(p: dict) -> tuple[tuple, tuple]:
    """(fparams, iparams) of the rows a benchmark of this key runs: sampled rows at temperature 0.8 with top-k
    3/4 of the slots (KS) and top-p 0.95 where the key has them, repetition penalty 1.2 where it has
    penalties; greedy rows where it has neither top-k nor the check."""
    sampled = p["KS"] > 0 or p["check"]
    f = (1.25 if sampled else 1.0, 0.95 if sampled else 1.0, -math.inf, 1.2 if p["pen"] else 1.0, 0.0, 0.0)
    return (f * p["B"], sum(((int(sampled), p["KS"] * 3 // 4, 0, b) for b in range(p["B"])), ()))


def _arrays(p: dict) -> dict:
    B, V, zero = p["B"], p["V"], ArraySpec("int32", (p["B"],), fill=0)
    counts = ArraySpec("int32", (B, V), role="out") if p["pen"] else absent("int32", 2)
    fparams, iparams = _bench_rows(p)
    return {"logits": ArraySpec(p["dtype"], (B, V)), "fparams": ArraySpec("float32", (B, FLOAT_PARAMS), values=fparams),
            "iparams": ArraySpec("int32", (B, INT_PARAMS), values=iparams),
            "eos": ArraySpec("int32", (p["E"],), high=V), "seen": counts, "out_counts": counts,
            "tokens": ArraySpec("int32", (B,), role="out"), "positions": zero, "finished": zero,
            "history": ArraySpec("int32", (B, p["L"]), role="out")}


def _scratch(p: dict, c: dict) -> dict:
    """Per chunk: max, sum of exp, the Gumbel draw (key, score, token), candidate count and bound, and the
    mass above the draw; per row, the candidate slots."""
    shape, f32 = (p["B"], _chunks(p, c)), "float32"
    slots = (p["B"], max(1, pow2_ceil(_chunks(p, c)) * p["KS"]))
    return {"cmax": ArraySpec(f32, shape, role="scratch"), "csum": ArraySpec(f32, shape, role="scratch"),
            "cbest_y": ArraySpec(f32, shape, role="scratch"), "cbest_z": ArraySpec(f32, shape, role="scratch"),
            "cbest_i": ArraySpec("int32", shape, role="scratch"), "ccount": ArraySpec("int32", shape, role="scratch"),
            "ckey": ArraySpec("int32", shape, role="scratch"), "cmass": ArraySpec(f32, shape, role="scratch"),
            "cand_z": ArraySpec(f32, slots, role="scratch"), "cand_i": ArraySpec("int32", slots, role="scratch")}


def _chunk_grid(p: dict, c: dict) -> tuple:
    return (p["B"], _chunks(p, c), 1)


def _check_grid(p: dict, c: dict) -> tuple:
    return (p["B"], _chunks(p, c), 1) if p["check"] else (0, 1, 1)


def _row_grid(p: dict, c: dict) -> tuple:
    return (p["B"], 1, 1)


def _scan_constants(p: dict, c: dict) -> tuple:
    return (c["CH"], p["KS"], p["E"], bool(p["pen"]))


def _check_constants(p: dict, c: dict) -> tuple:
    return (c["CH"], pow2_ceil(_chunks(p, c)), p["E"], bool(p["pen"]))


def _finish_constants(p: dict, c: dict) -> tuple:
    return (c["CH"], pow2_ceil(_chunks(p, c)), p["KS"], p["E"], bool(p["pen"]), bool(p["check"]))


_STATE = ("tokens", "positions", "history", "finished")


def _bind(a: list, flags: tuple) -> Binding:
    logits, fparams, iparams, eos, seen, out_counts, tokens, positions, history, finished = a
    slots, check = flags
    arrays.check_dtype(logits, "logits", arrays.FLOAT_DTYPES)
    if len(logits.shape) != 2:
        raise ValueError(f"logits must be 2-D (batch, vocab), got shape {logits.shape}")
    if logits.shape[1] < 1:
        raise ValueError(f"logits has no vocabulary to choose from (shape {logits.shape})")
    arrays.check_last_contiguous(logits, "logits")
    B, V = logits.shape
    expected = {"fparams": ("float32", (B, FLOAT_PARAMS)), "iparams": ("int32", (B, INT_PARAMS)),
                "tokens": ("int32", (B,)), "positions": ("int32", (B,)), "finished": ("int32", (B,))}
    for name, x in zip(("fparams", "iparams", "eos", "seen", "out_counts", *_STATE),
                       (fparams, iparams, eos, seen, out_counts, tokens, positions, history, finished)):
        if x is None:
            continue
        dtype, shape = expected.get(name, ("int32", None))
        arrays.check_dtype(x, name, (dtype,))
        if shape is not None and x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape}")
        if x.device != logits.device:
            raise ValueError(f"{name} is on GPU {x.device}, logits on GPU {logits.device}")
        arrays.check_contiguous(x, name)
    if not 1 <= len(eos.shape) == 1 <= eos.shape[0] <= MAX_EOS:
        raise ValueError(f"eos must hold 1..{MAX_EOS} int32 token ids (-1 for none), got shape {eos.shape}")
    if len(history.shape) != 2 or history.shape[0] != B:
        raise ValueError(f"history has shape {history.shape}, expected ({B}, L)")
    if (seen is None) != (out_counts is None):
        raise ValueError("pass both seen and out_counts (penalties), or neither")
    if seen is not None and (seen.shape != (B, V) or out_counts.shape != (B, V)):
        raise ValueError(f"seen and out_counts must have shape {(B, V)}, got {seen.shape} and {out_counts.shape}")
    if not isinstance(slots, int) or not (slots == 0 or (16 <= slots <= MAX_SLOTS and slots & (slots - 1) == 0)):
        raise ValueError(f"slots must be 0 or a power of two in 16..{MAX_SLOTS}, got {slots!r}")
    names = ("logits", "fparams", "iparams", "eos", "seen", "out_counts", *_STATE)
    views = {n: (i, None) for i, n in enumerate(names) if a[i] is not None}
    return Binding(problem=dict(dtype=logits.dtype, B=B, V=V, pen=int(seen is not None), KS=slots,
                                check=int(bool(check)), E=pow2_ceil(eos.shape[0]), L=history.shape[1]),
                   arrays=views, scalars={"pad": (0, 0)})


_ARGS = ("logits", "seen", "out_counts", "eos", "fparams", "iparams", "positions", "cmax", "csum", "cbest_y",
         "cbest_z", "cbest_i")

NEXT_TOKEN = Op(
    "next_token", args=("logits", "fparams", "iparams", "eos", "seen", "out_counts", *_STATE),
    optional=("seen", "out_counts"),
    key=dict(dtype=None, B=pow2_bucket, V=None, pen=None, KS=None, check=None),
    extras=dict(E=lambda p: 1, L=lambda p: 1025),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch, scalars=lambda p: {"pad": 0},
    launches=(Launch(next_token_scan_kernel, _chunk_grid, (*_ARGS, "ccount", "ckey", "cand_z", "cand_i"),
                     _scan_constants),
              Launch(next_token_check_kernel, _check_grid, (*_ARGS, "cmass"), _check_constants, hinted=False),
              Launch(next_token_finish_kernel, _row_grid,
                     (*_ARGS, "ccount", "ckey", "cand_z", "cand_i", "cmass", "tokens", "history", "finished", "pad"),
                     _finish_constants, hinted=False)),
    bind=_bind, choices=dict(pen=(0, 1), KS=(0, 16, 32, 64, 128, 256), check=(0, 1)),
    cli_defaults=dict(pen=0, KS=0, check=0), tune_whole=True)


def candidate_slots(top_ks) -> int:
    """The candidate slots per chunk for rows with these top_k values (0 for none): a power of two in
    16..MAX_SLOTS above the largest k (a chunk holds at most k of the row's top k) by at least k / 8 + 1, so
    that a chunk whose bound lands on tied scores rarely overflows its slots (bf16 logits tie often; an
    overflow runs the exact whole-row path). Rows with a larger k take that path."""
    k = max((int(v) for v in top_ks), default=0)
    return 0 if k <= 0 else min(MAX_SLOTS, max(16, pow2_ceil(k + k // 8 + 1)))


def next_token(logits, fparams, iparams, eos, tokens, positions, history, finished, *, seen=None, out_counts=None,
               slots: int = 0, check: bool = False, pad: int = 0) -> None:
    """Choose the next token of every row of logits (B, V) and advance the decode state in place.

    fparams float32 (B, 6): 1 / temperature (1 for greedy rows), top_p (1: off), log(min_p) (-inf: off),
    repetition, presence and frequency penalties. iparams int32 (B, 4): sample (0: greedy), top_k (0: off),
    the position below which eos ids are banned (min_new_tokens), the row's seed. eos: int32 (E,), the
    end-of-sequence ids, -1 padding. tokens, positions, finished: int32 (B,); history int32 (B, L): the
    token lands at history[b, positions[b] + 1], then positions[b] += 1; a finished row emits `pad`; a row
    finishes when it emits an eos id. seen, out_counts: int32 (B, V) token counts of prompt + output and
    of output only (penalties; both or neither), updated in place. slots: candidate_slots() of the rows'
    top_k; check: some row has top_p < 1 and no top_k. Both choose the kernels (part of the tuning key).
    """
    if not isinstance(pad, (int, np.integer)) or isinstance(pad, bool):
        raise TypeError(f"pad must be an int, got {type(pad).__name__}")
    NEXT_TOKEN((logits, fparams, iparams, eos, seen, out_counts, tokens, positions, history, finished),
               (slots, bool(check)), (int(pad),))


# -- the float64 reference ----------------------------------------------------------------------------


def _mix_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def gumbel_reference(idx, seed: int, pos: int, rnd: int = 0) -> np.ndarray:
    """The kernels' Gumbel noise of tokens idx for one row's seed, position and round (float64)."""
    with np.errstate(over="ignore"):
        u32 = np.uint32
        s = _mix_np(np.array(seed, np.int64).astype(u32) ^ u32(0x5BD1E995))
        s = _mix_np(s ^ (np.array(pos, np.int64).astype(u32) * u32(0x9E3779B1) + u32(rnd) * u32(0x7FEB352D)))
        h = _mix_np(_mix_np(np.asarray(idx, np.int64).astype(u32) * u32(0x9E3779B1) + s) ^ s)
    u = ((h >> u32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)
    return -np.log(-np.log(u.astype(np.float64)))


PARAM_NAMES = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty")


def pack_params(params: dict, eos_from, seeds) -> tuple[np.ndarray, np.ndarray]:
    """(fparams, iparams) for next_token from per-row parameters: `params` maps each of PARAM_NAMES to a (B,)
    array (temperature 0: greedy; top_k 0, top_p 1, min_p 0, penalties 1, 0, 0: off); eos_from (B,): the
    position below which the eos ids are banned; seeds (B,): each row's noise seed (any ints)."""
    t = np.asarray(params["temperature"], np.float64)
    greedy = t == 0
    min_p = np.asarray(params["min_p"], np.float64)
    with np.errstate(divide="ignore"):
        fparams = np.stack([np.where(greedy, 1.0, 1.0 / np.where(greedy, 1.0, t)),
                            np.where(greedy, 1.0, params["top_p"]),
                            np.where(greedy | (min_p <= 0), -np.inf, np.log(np.maximum(min_p, 1e-300))),
                            params["repetition_penalty"], params["presence_penalty"],
                            params["frequency_penalty"]], axis=1).astype(np.float32)
    iparams = np.stack([~greedy, np.where(greedy, 0, params["top_k"]), eos_from,
                        np.asarray(seeds, np.int64) & 0x7FFFFFFF], axis=1).astype(np.int32)
    return fparams, iparams


def next_token_reference(logits, seen, out_counts, params: dict, banned, eos_ids) -> np.ndarray:
    """The float64 scores each row samples from, -inf for every token removed (the module doc's order);
    a greedy row keeps only its first argmax of the penalised logits, so each row's softmax is the
    distribution it draws from. seen / out_counts (B, V): token counts of prompt + output and of the output;
    params: PARAM_NAMES -> (B,) arrays; banned (B,) bool: rows whose eos ids are removed."""
    x = np.array(logits, np.float64)
    p = {k: np.asarray(params[k])[:, None] for k in PARAM_NAMES}
    x = np.where(np.asarray(seen) > 0, np.where(x < 0, x * p["repetition_penalty"], x / p["repetition_penalty"]), x)
    x -= p["frequency_penalty"] * np.asarray(out_counts) + p["presence_penalty"] * (np.asarray(out_counts) > 0)
    eos = [e for e in eos_ids if e >= 0]
    for b in np.flatnonzero(banned):
        x[b, eos] = -np.inf
    greedy = p["temperature"][:, 0] == 0
    z = x / np.where(greedy[:, None], 1.0, p["temperature"])
    for b in np.flatnonzero(~greedy):
        z[b] = _warp(z[b], int(p["top_k"][b, 0]), float(p["top_p"][b, 0]), float(p["min_p"][b, 0]))
    for b in np.flatnonzero(greedy):
        best = np.argmax(x[b])
        z[b] = -np.inf
        z[b, best] = x[b, best]
    return z


def _warp(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """top_k, top_p and min_p on one row of temperature-scaled scores."""
    if 0 < top_k < z.size:
        z = np.where(z < np.partition(z, -top_k)[-top_k], -np.inf, z)
    if top_p < 1:
        e = np.exp(z - z.max())
        prob = e / e.sum()
        desc = np.sort(prob)[::-1]
        above = np.concatenate(([0.0], np.cumsum(desc)))   # above[i]: mass of the i most probable
        more_probable = above[np.searchsorted(-desc, -prob, side="left")]
        z = np.where(more_probable < top_p, z, -np.inf)
    if min_p > 0:
        z = np.where(np.exp(z - z.max()) >= min_p, z, -np.inf)
    return z


def check_next_token(B: int, V: int, dtype: str, draws: int = 20) -> None:
    """On the GPU: row 0 greedy with penalties and a banned eos must take the reference's argmax; rows 1.. sample
    (top-k with top-p, top-p alone, min-p) and must stay in their kept sets over `draws` draws."""
    import cupy

    from tilekit.kernels.checks import host, rand
    logits, rng = rand((B, V), dtype, 2.0), np.random.default_rng()
    kinds = [(0.0, 0, 1.0, 0.0), (0.8, 50, 0.95, 0.0), (1.0, 0, 0.5, 0.0), (0.7, 0, 1.0, 0.2)]
    rows = [kinds[0]] + [kinds[1 + (b - 1) % 3] for b in range(1, B)]
    params = {"temperature": np.array([r[0] for r in rows]), "top_k": np.array([r[1] for r in rows]),
              "top_p": np.array([r[2] for r in rows]), "min_p": np.array([r[3] for r in rows]),
              "repetition_penalty": np.full(B, 1.3), "presence_penalty": np.full(B, 0.2),
              "frequency_penalty": np.full(B, 0.1)}
    seen = rng.integers(0, 3, (B, V)).astype(np.int32)
    out_counts = np.minimum(seen, 1).astype(np.int32)
    eos = np.array([V // 2, -1], np.int32)
    fparams, iparams = pack_params(params, np.full(B, draws + 1), rng.integers(0, 1 << 30, B))   # eos always banned
    kept = next_token_reference(host(logits), seen, out_counts, params, np.ones(B, bool), eos) > -np.inf
    history = cupy.full((B, draws + 1), -1, cupy.int32)
    for step in range(draws):
        tokens, finished = cupy.full(B, -1, cupy.int32), cupy.zeros(B, cupy.int32)
        positions = cupy.full(B, step, cupy.int32)
        next_token(logits, cupy.asarray(fparams), cupy.asarray(iparams), cupy.asarray(eos), tokens, positions,
                   history, finished, seen=cupy.asarray(seen), out_counts=cupy.asarray(out_counts),
                   slots=candidate_slots(params["top_k"][1:]), check=True)
    drawn = host(history)[:, 1:]
    assert (drawn[0] == np.argmax(kept[0])).all(), "the greedy row is not the argmax of its penalised logits"
    for b in range(1, B):
        assert kept[b][drawn[b]].all(), f"row {b} ({rows[b]}) drew tokens outside its kept set"


if __name__ == "__main__":
    from tilekit.kernels.next_token import check_next_token  # the package's op, not this script's copy
    for B, V, dtype in [(4, 50257, "bfloat16"), (7, 1031, "float32"), (3, 128256, "bfloat16")]:
        check_next_token(B, V, dtype)
        print(f"next_token B{B} V{V} {dtype}: ok (greedy argmax exact, samples within their kept sets)")

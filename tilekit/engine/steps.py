"""The passes of a static batch and their device buffers: forward() over whole prompts (no cache), a prompt prefill
that fills the KV cache (whole, or in chunks past the model's prefill_chunk) and one decode step, each prefill and
step ending in the next-token pick on the GPU (kernels.next_token). The same code runs on CuPy arrays and, for the
tuning workload, on MetaArrays (tilekit.engine.workload)."""

from __future__ import annotations

from tilekit.engine.kv_cache import new_cache
from tilekit.engine.picker import GREEDY, Picker
from tilekit.kernels import next_token, token_bitmask
from tilekit.kernels.next_token import FLOAT_PARAMS, INT_PARAMS
from tilekit.kernels.token_bitmask import words
from tilekit.models.base import Arrays, CausalLM

PAD = 64          # prompts pad to, and KV caches grow in, multiples of this many positions
LOGIT_ROW_ALIGN = 64   # forward()'s logits rows are padded to multiples of this many entries


class PromptBuffers:
    """Static inputs and activations of one (batch, tokens) prefill: flat ids and positions, the rows
    of each sequence's newest token, KV-cache write offsets (zeros), and the model's activations;
    a Generation keeps its prefill graph here once captured."""

    def __init__(self, model: CausalLM, batch: int, tokens: int, arrays: Arrays):
        self.shape = (batch, tokens)
        self.ids = arrays.zeros((batch * tokens,), "int32")
        self.positions = arrays.positions(batch, tokens)
        self.last = arrays.zeros((batch,), "int32")
        self.zeros = arrays.zeros((batch,), "int32")
        self.acts = model.activations(batch, tokens, arrays)
        self.graph, self.runs = None, 0


class DecodeState:
    """generate()'s device buffers for B sequences of up to `capacity` positions, and the kernels of
    its two steps: a prompt prefill that fills the KV cache, and one decode step, each ending in the
    next-token pick that `picker` describes (per-row parameters in fparams / iparams)."""

    def __init__(self, model: CausalLM, batch: int, capacity: int, arrays: Arrays, picker: Picker = GREEDY,
                 kv_cache_dtype: str = "auto"):
        self.model, self.batch, self.picker = model, batch, picker
        V = model.config.vocab_size
        self.cache = new_cache(model, batch, capacity, arrays, kv_cache_dtype)
        self.tokens = arrays.zeros((batch,), "int32")
        self.positions = arrays.zeros((batch,), "int32")        # each sequence's newest position
        self.finished = arrays.zeros((batch,), "int32")
        self.history = arrays.zeros((batch, capacity + 1), "int32")
        self.fparams = arrays.zeros((batch, FLOAT_PARAMS), "float32")
        self.iparams = arrays.zeros((batch, INT_PARAMS), "int32")
        self.eos = arrays.zeros((max(1, len(picker.eos)),), "int32")
        self.seen = arrays.zeros((batch, V), "int32") if picker.penalties else None
        self.out_counts = arrays.zeros((batch, V), "int32") if picker.penalties else None
        self.acts = model.activations(batch, 1, arrays)
        self.logits = arrays.empty((batch, V), model.dtype)
        self.bitmask = arrays.zeros((batch, words(V)), "int32") if picker.masked else None   # structured output

    def prefill(self, buf: PromptBuffers, start: int = 0, final: bool = True) -> None:
        """Fill the KV cache from padded prompts (their positions start.. of each sequence: a chunk of a longer
        prompt whose earlier positions are cached, prefill_pieces) and, for the final piece, pick each
        sequence's first new token."""
        if start:
            attend = self.model.prefill_attend(self.cache, buf.zeros + start, past=start)
            x = self.model.hidden(buf.acts, buf.ids, buf.positions + start, attend)
        else:         # a whole prompt: the family's own prefill_attend (DeepSeek-V2's takes no past)
            x = self.model.hidden(buf.acts, buf.ids, buf.positions, self.model.prefill_attend(self.cache, buf.zeros))
        if final:
            self._logits(x, buf.last)
            self.pick()

    def step(self) -> None:
        """One token for every sequence."""
        self.step_logits()
        self.pick()

    def step_logits(self) -> None:
        """A decode step up to its logits (structured output runs the pick apart, its masks made meanwhile)."""
        attend = self.model.decode_attend(self.cache, self.positions)
        self._logits(self.model.hidden(self.acts, self.tokens, self.positions, attend), None)

    def _logits(self, x, rows) -> None:
        """Final norm (of `rows` only, when given) and logits."""
        self.model.final_norm(x, self.acts.h, rows=rows)
        self.model.lm_head(self.acts.h, out=self.logits)

    def pick(self) -> None:
        """The next-token pick from the logits (the bitmask applied first, where structured output keeps one)."""
        p = self.picker
        if self.bitmask is not None:
            token_bitmask(self.logits, self.bitmask)
        next_token(self.logits, self.fparams, self.iparams, self.eos, self.tokens, self.positions, self.history,
                   self.finished, seen=self.seen, out_counts=self.out_counts, slots=p.slots, check=p.check, pad=p.pad)


def forward_hidden(model: CausalLM, buf: PromptBuffers) -> None:
    """forward() up to the LM head: the blocks over whole prompts (no KV cache), then the final norm
    into buf.acts.h."""
    x = model.hidden(buf.acts, buf.ids, buf.positions, model.forward_attend())
    model.final_norm(x, buf.acts.h)


def capacity_for(model: CausalLM, prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """(KV-cache capacity, padded prompt length) of a generate call."""
    capacity = min(model.context_length, -(-(prompt_len + new_tokens) // PAD) * PAD)
    return capacity, min(capacity, -(-prompt_len // PAD) * PAD)


def prefill_pieces(model: CausalLM, tokens: int, newest: int, cache) -> list[tuple[int, int]]:
    """(start, tokens) of the passes that prefill prompts padded to `tokens`: one, or, past model.prefill_chunk
    tokens with a cache that takes chunks (kv_cache.KVCache in the model's dtype: later chunks attend over the cached keys and values of the earlier
    ones: not FP8 codes, not a latent cache), chunks of prefill_chunk tokens up to the PAD block that holds `newest`
    (the shortest prompt's newest position), then one pass over the rest, which holds every prompt's newest token
    (longer than a chunk only where the prompts' lengths differ by more)."""
    chunk = model.prefill_chunk
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0 or chunk % PAD:
        raise ValueError(f"prefill_chunk must be 0 (off) or a positive multiple of {PAD}, got {chunk!r}")
    tail = newest // PAD * PAD
    if not chunk or tokens <= chunk or not cache.chunked_prefill or not tail:
        return [(0, tokens)]
    return [(s, min(chunk, tail - s)) for s in range(0, tail, chunk)] + [(tail, tokens - tail)]


def logits(model: CausalLM, h, arrays: Arrays):
    """The LM head of the rows h into a fresh (rows, vocab_size) array: a view of a buffer whose rows are padded to a
    multiple of LOGIT_ROW_ALIGN entries (scratch), so that an odd vocabulary's rows (GPT-2's 50257) start aligned
    and store faster (the LM head 1.08-1.10x, H200). Tensor-parallel: an unpadded array (the all-reduce sums whole
    buffers)."""
    vocab = model.config.vocab_size
    if model.comm:
        return model.lm_head(h, out=arrays.empty((h.shape[0], vocab), model.dtype))
    padded = arrays.empty((h.shape[0], -(-vocab // LOGIT_ROW_ALIGN) * LOGIT_ROW_ALIGN), model.dtype)
    return model.lm_head(h, out=padded[:, :vocab])

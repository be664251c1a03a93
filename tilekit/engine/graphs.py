"""CUDA graphs of a model's passes: a static batch's Generation (its decode step and prompt prefills, captured on
the generation's own stream and replayed) and forward()'s PrefillGraph per (batch, tokens) and caller stream."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np

from tilekit.autotune.arrays import release_scratch
from tilekit.engine.picker import Picker
from tilekit.engine.steps import DecodeState, PromptBuffers, forward_hidden, logits, prefill_pieces
from tilekit.models.base import Arrays, CausalLM


def capture(stream, fn) -> object:
    """fn()'s kernels on `stream` recorded as a CUDA graph (nothing runs)."""
    stream.begin_capture()
    try:
        fn()
    except BaseException:
        stream.end_capture()
        raise
    return stream.end_capture()


class Generation:
    """A DecodeState on its own stream, with CUDA graphs of its decode step and of prompt prefills."""

    max_prompt_shapes = 2

    def __init__(self, model: CausalLM, batch: int, capacity: int, picker: Picker, kv_cache_dtype: str = "auto"):
        import cupy
        import cupyx
        self.model, self.batch = model, batch
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.state = DecodeState(model, batch, capacity, Arrays(), picker, kv_cache_dtype)
        self.prompts: OrderedDict[int, PromptBuffers] = OrderedDict()
        self.graphs: dict[str, object] = {}        # DecodeState method name -> its captured graph
        self.host_tokens = cupyx.empty_pinned((batch,), np.int32)     # pinned: copies that do not wait for the host
        self.host_finished = cupyx.empty_pinned((batch,), np.int32)
        self.host_bitmask = cupyx.empty_pinned(self.state.bitmask.shape, np.int32) if picker.masked else None
        weakref.finalize(self, release_scratch, self.stream.ptr)   # also when dropped unreleased

    def start(self, history: np.ndarray, positions: np.ndarray, fparams: np.ndarray, iparams: np.ndarray,
              seen: np.ndarray | None) -> None:
        """A new call: the prompts in history, each sequence's newest position, nothing finished, the rows'
        sampling parameters, and with penalties each prompt's token counts."""
        state = self.state
        state.history.set(history)
        state.positions.set(positions)
        state.finished.fill(0)
        state.fparams.set(fparams)
        state.iparams.set(iparams)
        eos = np.full(state.eos.shape, -1, np.int32)
        eos[:len(state.picker.eos)] = state.picker.eos
        state.eos.set(eos)
        if seen is not None:
            state.seen.set(seen)
            state.out_counts.fill(0)

    def prefill(self, ids: np.ndarray, lengths: np.ndarray, use_graph: bool) -> None:
        """Run the prompt prefill of padded prompts ids (B, T) of `lengths` tokens. A prompt length seen twice
        replays a graph; a prompt longer than the model's prefill_chunk runs in chunks (prefill_pieces), eagerly."""
        T = ids.shape[1]
        pieces = prefill_pieces(self.model, T, int(lengths.min()) - 1, self.state.cache)
        if len(pieces) > 1:
            for start, n in pieces:
                self.state.prefill(self._buffers(ids, lengths, start, n), start, final=start + n == T)
            return
        buf = self._buffers(ids, lengths, 0, T)
        if use_graph and buf.graph is not None:
            buf.graph.launch(self.stream)
            return
        self.state.prefill(buf)
        buf.runs += 1
        if use_graph and buf.runs >= 2:        # a prompt shape seen twice: replay it from now on
            buf.graph = capture(self.stream, lambda: self.state.prefill(buf))

    def _buffers(self, ids: np.ndarray, lengths: np.ndarray, start: int, T: int) -> PromptBuffers:
        """The prompt buffers of T tokens a sequence (the last max_prompt_shapes lengths are kept), holding the
        padded prompts' positions start.. start + T and the rows of each sequence's newest token."""
        buf = self.prompts.pop(T, None)
        if buf is None:
            with self.stream:
                buf = PromptBuffers(self.model, self.batch, T, Arrays())
        self.prompts[T] = buf
        while len(self.prompts) > self.max_prompt_shapes:
            self.prompts.popitem(last=False)
        buf.ids.set(np.ascontiguousarray(ids[:, start:start + T]).reshape(-1))
        buf.last.set(np.arange(len(ids), dtype=np.int32) * T + lengths - 1 - start)
        return buf

    @property
    def decode_graph(self):
        """The captured decode step (None before its first run)."""
        return self.graphs.get("step")

    def decode(self, use_graph: bool, part: str = "step") -> None:
        """One token for every sequence (part "step"), or half of it: "step_logits" (up to the logits) or "pick"
        (structured output computes its masks between the two). Each part's first call runs eagerly and captures it."""
        graph = self.graphs.get(part) if use_graph else None
        if graph is not None:
            graph.launch(self.stream)
            return
        run = getattr(self.state, part)
        run()
        if use_graph:
            self.graphs[part] = capture(self.stream, run)

    def set_finished(self, done: np.ndarray) -> None:
        """Mark the rows the host has stopped (a stop string, a complete grammar) finished for the next pick, without
        waiting for the work queued before it (the device's own finished rows, at an eos id, are among them)."""
        self.host_finished[...] = done
        self.state.finished.set(self.host_finished, stream=self.stream)

    def set_bitmask(self) -> None:
        """Queue host_bitmask's copy to the next pick's bitmask."""
        self.state.bitmask.set(self.host_bitmask, stream=self.stream)

    def copy_tokens(self):
        """Queue the picked tokens' copy to host_tokens (pinned) on the stream; returns the event to wait on before
        reading them, which later work queued on the stream does not delay."""
        self.state.tokens.get(stream=self.stream, out=self.host_tokens, blocking=False)
        return self.stream.record()

    def release(self) -> None:
        """Wait for this generation's work, then drop its graphs and its stream's work arrays."""
        self.stream.synchronize()
        self.graphs.clear()
        for buf in self.prompts.values():      # a caller may still hold a buffer: not its graph
            buf.graph = None
        self.prompts.clear()
        release_scratch(self.stream.ptr)


class PrefillGraph:
    """forward() at one (B, T) on one caller stream: static buffers, and the blocks and final norm as
    one CUDA graph, captured on a private stream at the first run."""

    def __init__(self, model: CausalLM, batch: int, tokens: int):
        import cupy
        self.model, self.shape = model, (batch, tokens)
        self.capture_stream = cupy.cuda.Stream(non_blocking=True)
        with self.capture_stream:
            self.buf = PromptBuffers(model, batch, tokens, Arrays())
        self.graph, self.last_run, self.released = None, None, False
        self.lock = threading.Lock()
        weakref.finalize(self, release_scratch, self.capture_stream.ptr)

    def _capture(self):
        """One eager pass first (compiles kernels, creates their per-stream scratch), then capture."""
        with self.capture_stream:
            forward_hidden(self.model, self.buf)
            return capture(self.capture_stream, lambda: forward_hidden(self.model, self.buf))

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
                self.buf.ids.set(ids.reshape(-1))
                self.graph.launch(stream)
                out = logits(self.model, self.buf.acts.h, Arrays())
                self.last_run = stream.record()
                return out.reshape(*self.shape, -1)

    def release(self) -> None:
        """Wait for the last run that reads this graph's buffers, then drop the graph."""
        with self.lock:
            self.released = True
            self.capture_stream.synchronize()
            if self.last_run is not None:
                self.last_run.synchronize()
            self.graph = None
            release_scratch(self.capture_stream.ptr)

"""The stop rules of a generation: eos ids, stop strings over the decoded continuation, max_new_tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tilekit.engine.sampling import GenerationSettings


class StopChecker:
    """Which rows of a batch have stopped, fed each step's new tokens (and their decoded text).

    A row stops after the token that (a) is one of the eos ids, (b) completes a stop string in the row's
    decoded continuation, or (c) is its max_new_tokens-th; that token is kept. Rows stop independently and
    tokens given for a stopped row are ignored. As in HF, min_new_tokens is not a stop rule: process_logits
    keeps eos from being generated before it. Stop strings follow HF's StopStringCriteria: a match is the
    string occurring in the text, ending within the newest token's text (so a token running past the string,
    "st" + "opped" for "stop", also stops), but here only the continuation's text is searched, never the prompt.
    """

    def __init__(self, batch: int, settings: GenerationSettings):
        if settings.max_new_tokens is None:
            raise ValueError("max_new_tokens must be set to check stops")
        self.settings = settings
        self.eos = frozenset(int(t) for t in settings.eos_token_ids)
        self.lengths = np.zeros(batch, np.int64)       # tokens each row keeps
        self.done = np.full(batch, settings.max_new_tokens == 0)
        self.tails = [""] * batch        # the last characters of each row's text that a stop string can span
        self.keep = max(map(len, settings.stop_strings), default=1) - 1

    def update(self, tokens: Sequence[int], pieces: Sequence[str] | None = None) -> None:
        """Take one step's (B,) new tokens and, with stop strings, the text each one printed (TextStream.push)."""
        tokens = np.asarray(tokens, np.int64)
        if tokens.shape != self.done.shape:
            raise ValueError(f"tokens must have shape {self.done.shape}, got {tokens.shape}")
        if self.settings.stop_strings and (pieces is None or len(pieces) != len(tokens)):
            raise ValueError("stop strings need each row's decoded text piece")
        for b in np.flatnonzero(~self.done).tolist():
            self.took(b, int(tokens[b]), pieces[b] if pieces is not None else "")

    def took(self, b: int, token: int, piece: str = "") -> bool:
        """Row b (still running) takes one new token, which printed `piece`; whether the row stops with it. The
        engine feeds its requests' rows one at a time through this."""
        stop = self.ends(b, token)
        self.lengths[b] += 1
        if self.settings.stop_strings:
            text = self.tails[b] + piece
            stop = stop or any(s in text for s in self.settings.stop_strings)
            self.tails[b] = text[-self.keep:] if self.keep else ""
        self.done[b] = stop
        return stop

    def ends(self, b: int, token: int) -> bool:
        """Whether row b's next token ends it by a rule that needs no text: an eos id, or its max_new_tokens-th."""
        return self.lengths[b] + 1 == self.settings.max_new_tokens or token in self.eos

    @property
    def all_done(self) -> bool:
        return bool(self.done.all())

"""What every runner of a model offers besides generate() itself: the checkpoint's generation defaults, one
resolution of generate()'s arguments, text in and out with exact streaming, and chat through the checkpoint's
template. A runner is made from a model (models/running.py's LanguageModel asks for it); StaticRunner
(tilekit.engine.static) runs the GPU models in static batches, RecomputeRunner (tilekit.engine.recompute) the NumPy
references."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tilekit.checkpoints import ModelFileError
from tilekit.engine.sampling import SAMPLING_FIELDS, GenerationSettings, SamplingParams, per_row
from tilekit.engine.text import TextStream, chat_template, load_tokenizer, tokenizer_failures


class Runner:
    """The shared half of a runner of `model` (see the module doc); a subclass implements generate()."""

    def __init__(self, model):
        self.model = model
        self._tokenizer = None
        self._vocabulary = None

    def generate(self, ids, max_new_tokens: int | None = None, **options) -> list[np.ndarray]:
        raise NotImplementedError

    def generation_defaults(self) -> GenerationSettings:
        """What generate() does unless told otherwise: the checkpoint's generation_config.json read as Hugging
        Face reads it (greedy unless it says do_sample), with config.json's eos ids; greedy for a model
        without a checkpoint directory."""
        eos = getattr(self.model.config, "eos_token_id", None)
        if self.model.checkpoint is not None:
            return GenerationSettings.from_generation_config(self.model.checkpoint, config_eos=eos,
                                                             vocab_size=self.model.config.vocab_size)
        return GenerationSettings(eos_token_ids=() if eos is None else eos, sampling=SamplingParams(temperature=0.0))

    def generation_plan(self, prompts: Sequence[np.ndarray], max_new_tokens: int | None,
                        sampling: Sequence[SamplingParams] | None, **explicit):
        """(settings, one SamplingParams per row, one TextStream per row when stop strings need the text, else
        None) of a generate() call on `prompts`: explicit arguments over generation_defaults(), every one
        checked (ValueError naming it) before anything runs."""
        scalars = {k: explicit[k] for k in SAMPLING_FIELDS}
        if sampling is not None and any(v is not None for v in scalars.values()):
            raise ValueError("pass sampling= (one SamplingParams per row) or the scalar sampling arguments, not both")
        settings = self.generation_defaults().override(max_new_tokens=max_new_tokens, **explicit)
        rows = per_row(settings.sampling if sampling is None else list(sampling), len(prompts))
        if settings.max_new_tokens is None:
            raise ValueError("max_new_tokens must be given (the checkpoint's generation_config.json sets none)")
        V, longest = self.model.config.vocab_size, max(len(p) for p in prompts)
        if any(e >= V for e in settings.eos_token_ids):
            raise ValueError(f"eos_token_id must lie in [0, {V}), got {list(settings.eos_token_ids)}")
        if longest + settings.max_new_tokens > self.model.context_length:
            given = "" if max_new_tokens is not None else " (generation_config.json's)"
            raise ValueError(f"prompt length {longest} + max_new_tokens {settings.max_new_tokens}{given} "
                             f"exceeds {self.model.context_limit_message()}")
        streams = None
        if settings.stop_strings:
            tokenizer, source = self.tokenizer(), self._tokenizer_file()
            streams = [TextStream(tokenizer, context=[int(t) for t in p], source=source) for p in prompts]
        return settings, rows, streams

    def constraint(self, response_format):
        """Structured output's matcher (tilekit.engine.grammar.Constraint) of a response_format over the checkpoint's
        vocabulary, or None for free text; a ValueError naming response_format for a malformed one."""
        from tilekit.engine.grammar import Constraint, grammar_of, vocabulary
        grammar = grammar_of(response_format, check=False)        # Constraint checks it against the vocabulary
        if grammar is None:
            return None
        if not self.has_tokenizer():
            raise ValueError("response_format needs the checkpoint's tokenizer (tokenizer.json or vocab.json)")
        V = self.model.config.vocab_size
        if self._vocabulary is None:        # built once a runner
            with tokenizer_failures(self._tokenizer_file(), "cannot give structured output's vocabulary"):
                self._vocabulary = vocabulary(self.tokenizer().to_str(), V,
                                              tuple(self.generation_defaults().eos_token_ids))
        return Constraint(self._vocabulary, grammar, V)

    def constraints(self, response_format, rows: int) -> list | None:
        """One matcher a row for generate() (copies of one compile), or None without a response_format."""
        first = self.constraint(response_format) if response_format is not None else None
        return None if first is None else [first] + [first.copy() for _ in range(rows - 1)]

    def has_tokenizer(self) -> bool:
        """Whether the checkpoint has a tokenizer (tokenizer.json, or vocab.json + merges.txt)."""
        checkpoint = self.model.checkpoint
        return checkpoint is not None and (checkpoint.has("tokenizer.json") or checkpoint.has("vocab.json"))

    def tokenizer(self):
        """The checkpoint's tokenizer (tokenizer.json, or GPT-2's vocab.json + merges.txt), read as untrusted once and
        kept."""
        if self._tokenizer is None:
            if self.model.checkpoint is None:
                raise ValueError("this model has no checkpoint directory to read a tokenizer from (load it with "
                                 "from_pretrained)")
            self._tokenizer = load_tokenizer(self.model.checkpoint)
        return self._tokenizer

    def generate_text(self, prompt: str | Sequence[str], max_new_tokens: int | None = None, *,
                      stream_to: Callable[[str], None] | None = None, chat: bool = False,
                      **kwargs) -> str | list[str]:
        """Tokenize `prompt` (or a list of prompts, one batch) with the checkpoint's tokenizer, generate
        (kwargs as for generate()), and return the continuation's text; stream_to(piece) receives it
        piece by piece as it is made (one prompt only): the pieces concatenate to exactly the returned
        text, characters that span tokens included. chat=True sends each prompt as one user message
        through the checkpoint's chat template (see chat())."""
        single = isinstance(prompt, str)
        texts = [prompt] if single else list(prompt)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        if stream_to is not None and not single:
            raise ValueError("stream_to streams one prompt; pass a string, or no stream_to for a batch")
        if chat:
            ids = [self._chat_ids([{"role": "user", "content": t}]) for t in texts]
        else:
            ids = [self._encoded(t) for t in texts]
        out = self._continue_text(ids, max_new_tokens, stream_to, kwargs)
        return out[0] if single else out

    def chat(self, messages: Sequence[dict], max_new_tokens: int | None = None, *,
             stream_to: Callable[[str], None] | None = None, **kwargs) -> str:
        """The assistant's reply to `messages` ([{"role": "system" | "user" | "assistant" | "tool",
        "content": ...}, ...]), the conversation rendered with the checkpoint's chat template as Hugging
        Face's apply_chat_template renders it; kwargs as for generate()."""
        return self._continue_text([self._chat_ids(messages)], max_new_tokens, stream_to, kwargs)[0]

    def chat_template(self):
        """The checkpoint's chat template (chat_template.jinja or tokenizer_config.json's chat_template);
        ValueError when it has none."""
        template = None if self.model.checkpoint is None else chat_template(self.model.checkpoint)
        if template is None:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json's chat_template or "
                             "chat_template.jinja)")
        return template

    def _chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of `messages` rendered with the chat template (which writes its own special tokens)."""
        return self._encoded(self.chat_template().render(messages), add_special_tokens=False)

    def _encoded(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` by the checkpoint's tokenizer; a tokenizer that fails on it, or makes an id past the
        model's vocabulary, is a ModelFileError naming the checkpoint's tokenizer (its file is untrusted)."""
        tokenizer = self.tokenizer()
        with tokenizer_failures(self._tokenizer_file(), "cannot encode the prompt"):
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        V = self.model.config.vocab_size
        if any(i >= V for i in ids):
            raise ModelFileError(self._tokenizer_file(), f"makes token id {max(ids)}, past the model's vocabulary "
                                                         f"of {V} (config.json's vocab_size)")
        return ids

    def _tokenizer_file(self):
        """The file the checkpoint's tokenizer was read from (tokenizer.json, else vocab.json): what errors name."""
        return self.model.checkpoint.directory / ("tokenizer.json" if self.model.checkpoint.has("tokenizer.json") else
                                            "vocab.json")

    def _continue_text(self, ids: list[list[int]], max_new_tokens: int | None, stream_to, kwargs) -> list[str]:
        """The decoded continuations of prompts `ids`, row 0's streamed to stream_to as it is made."""
        if not all(ids):
            raise ValueError("prompt encodes to no tokens")
        tokenizer, source = self.tokenizer(), self._tokenizer_file()
        streams = [TextStream(tokenizer, context=i, source=source) for i in ids]
        on_token = None
        if stream_to is not None:
            def on_token(tokens):
                piece = streams[0].push(tokens[0])
                if piece:
                    stream_to(piece)
        seqs = self.generate(ids, max_new_tokens, on_token=on_token, **kwargs)
        for b, (stream, seq) in enumerate(zip(streams, seqs)):
            if stream_to is None or b > 0:
                for t in seq[len(ids[b]):]:
                    stream.push(t)
            rest = stream.flush()
            if stream_to is not None and b == 0 and rest:
                stream_to(rest)
        return [s.printed for s in streams]

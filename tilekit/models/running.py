"""What every model offers its users besides its math: generate, text, chat, forward; each a thin call into the
runner that runs it. Running a model is the engine's business (tilekit.engine, the layer above the models): when
it is imported (importing tilekit imports it) it registers here the function that makes a model's runner, so that
no model module imports the engine.
"""

from __future__ import annotations

from typing import Callable

_make_runner: Callable | None = None


def register_runner(make: Callable) -> None:
    """make(model) -> the runner of `model` (the engine calls this once, on import)."""
    global _make_runner
    _make_runner = make


class LanguageModel:
    """A model that generates: `config` (vocab_size, block_size, eos_token_id), `checkpoint` (a
    checkpoints.Checkpoint, None without one) and `rope_positions`; generate() and the rest run on its runner
    (tilekit.engine: static batches on the GPU for CausalLM, recomputation for the NumPy references), made on first
    use and kept."""

    checkpoint = None
    rope_positions: int | None = None     # positions the model's rotary tables cover (None: no tables)
    _runner = None

    @property
    def context_length(self) -> int:
        """The longest sequence the model runs: block_size, or fewer where its rotary tables stop."""
        return min(self.config.block_size, self.rope_positions or self.config.block_size)

    def context_limit_message(self) -> str:
        """How the context length is set, for errors."""
        if self.context_length == self.config.block_size:
            return f"block_size {self.config.block_size}"
        return f"the {self.context_length} positions of the rotary tables (block_size {self.config.block_size})"

    @property
    def runner(self):
        """The engine's runner of this model (tilekit.engine), made on first use."""
        if self._runner is None:
            if _make_runner is None:      # tilekit/__init__.py imports tilekit.engine, which registers it
                raise RuntimeError("no runner is registered: tilekit.engine was not imported")
            self._runner = _make_runner(self)
        return self._runner

    def generate(self, ids, max_new_tokens: int | None = None, **options):
        """Continue each prompt of `ids` by up to `max_new_tokens` tokens: see the runner's generate()
        (tilekit.engine.static.StaticRunner.generate for the GPU models)."""
        return self.runner.generate(ids, max_new_tokens, **options)

    def generate_text(self, prompt, max_new_tokens: int | None = None, **options):
        """The continuation's text of `prompt` (a string or a list): tilekit.engine.runner.Runner.generate_text."""
        return self.runner.generate_text(prompt, max_new_tokens, **options)

    def chat(self, messages, max_new_tokens: int | None = None, **options) -> str:
        """The assistant's reply to `messages` through the checkpoint's chat template: Runner.chat."""
        return self.runner.chat(messages, max_new_tokens, **options)

    def generation_defaults(self):
        """What generate() does unless told otherwise (the checkpoint's generation_config.json): Runner's."""
        return self.runner.generation_defaults()

    def tokenizer(self):
        """The checkpoint's tokenizer, read as untrusted (tilekit.engine.text.load_tokenizer)."""
        return self.runner.tokenizer()

    def chat_template(self):
        """The checkpoint's chat template; ValueError when it has none."""
        return self.runner.chat_template()

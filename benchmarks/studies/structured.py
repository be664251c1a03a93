"""What structured output costs: decode ms/token with a JSON-schema constraint against the same run unconstrained,
at batch 1 through generate() and at 64 concurrent requests through the engine; and the host's mask time per step.

    python -m benchmarks.studies.structured [--preset gpt2] [--tokens 256] [--out DIR]

The checkpoint is random weights at the preset's shapes with a byte-level BPE tokenizer trained here to the
preset's vocabulary (no real tokenizer is needed, and none can be downloaded on the GPU hosts). The schema asks for a
string of 3000 or more characters, which no output of --tokens tokens completes, so that the constrained and the free
runs make the same number of tokens (each stopped by its length): batch 1 decode is (the time of --tokens + 1 new
tokens - the time of 1) / --tokens, each after a run of the same length; the engine's is its wall time over the
tokens each request made. A constrained output is checked token by token by a fresh matcher of the schema (every
token one it allows; one it refuses fails the row), a free one for its length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.studies.continuous import synchronize

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 3000, "maxLength": 3500},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 4}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "study", "schema": SCHEMA}}


def train_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer of vocab_size ids (id 0 its end token) trained on random words and JSON."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = np.random.default_rng(seed)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 10)))
             for _ in range(min(40000, 4 * vocab_size))]
    texts = [" ".join(rng.choice(words, 200)) + ' {"name": "x", "n": 12, "tags": ["a", "b"]} 0123456789.'
             for _ in range(min(4000, 200 + vocab_size // 12))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       special_tokens=["<|endoftext|>"]))
    return tok


def write_checkpoint(preset: str, directory: Path) -> None:
    from tilekit.models.families import family_of_config, preset_config
    config = preset_config(preset)
    family_of_config(config).model_class(config, dtype="bfloat16", seed=0).save_pretrained(directory)
    train_tokenizer(config.vocab_size).save(str(directory / "tokenizer.json"))
    for name in ("config.json", "generation_config.json"):           # the trained tokenizer's end token is id 0
        path = directory / name
        if path.is_file():
            fields = json.loads(path.read_text())
            fields.update(eos_token_id=0, bos_token_id=0)
            path.write_text(json.dumps(fields))


def allowed(runner, tokens: list[int]) -> bool:
    """Whether a fresh matcher of FORMAT allows every token of `tokens`, one after another (a prefix of an answer)."""
    constraint = runner.constraint(FORMAT)
    return all(constraint.accept(t) for t in tokens)


def timed(fn):
    synchronize()
    start = time.perf_counter()
    out = fn()
    synchronize()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="new tokens of every run (default 256)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tilekit-structured"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", type=Path, help="after the timed runs, a cProfile of the constrained engine run "
                                                     "(the 25 costliest functions by own time) into this file")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.tokens < 2:
        parser.error("--requests must be at least 1 and --tokens at least 2")
    import numpy as np

    from tilekit.engine.llm import LLMEngine
    from tilekit.models import load_model
    checkpoint = args.work / args.preset
    if not (checkpoint / "tokenizer.json").is_file():
        write_checkpoint(args.preset, checkpoint)
    model = load_model(checkpoint, dtype="bfloat16")
    runner, n = model.runner, args.tokens
    prompt = [int(t) for t in np.random.default_rng(1).integers(1, model.config.vocab_size, 32)]
    rows = []

    def made(fmt, seqs) -> tuple[int, bool]:
        """Tokens made by every output, and whether each has n and (constrained) only allowed ones."""
        outs = [[int(t) for t in s] for s in seqs]
        return sum(map(len, outs)), all(len(o) == n and (fmt is None or allowed(runner, o)) for o in outs)

    def b1(fmt):
        def run(k):
            return model.generate([prompt], k, temperature=0, eos_token_id=[], response_format=fmt)
        run(n + 1), run(1)                      # warm-up: the same lengths, graphs captured
        long_s, seqs = timed(lambda: run(n + 1))
        one_s, _ = timed(lambda: run(1))
        return (long_s - one_s) / n, made(fmt, [seqs[0][len(prompt):len(prompt) + n]])

    def check(fmt, ok) -> str:
        return "ok" if ok else f"FAILED: {'a token the schema does not allow, or ' if fmt else ''}not {n} tokens"

    (free_s, (_, free_ok)), (json_s, (_, json_ok)) = b1(None), b1(FORMAT)
    rows.append(dict(case="generate B1", free_ms_per_token=1e3 * free_s, json_ms_per_token=1e3 * json_s,
                     tokens=(n, n), check=check(None, free_ok) if not free_ok else check(FORMAT, json_ok)))
    engine = LLMEngine(model, max_running=args.requests, token_budget=2048,
                       max_len=min(model.context_length, 32 + n + 1), gpu_memory_utilization=0.3)
    prompts = [[int(t) for t in np.random.default_rng(2 + i).integers(1, model.config.vocab_size, 32)]
               for i in range(args.requests)]

    def many(fmt):
        options = dict(ignore_eos=True) if fmt is None else dict(response_format=fmt)
        engine.generate(prompts[:2], n, temperature=0, **options)          # warm-up
        seconds, outs = timed(lambda: engine.generate(prompts, n, temperature=0, **options))
        return seconds, made(fmt, [o["token_ids"] for o in outs])
    (free_s, (n_free, free_ok)), (json_s, (n_json, json_ok)) = many(None), many(FORMAT)
    rows.append(dict(case=f"engine x{args.requests}", free_ms_per_token=1e3 * free_s / (n_free / args.requests),
                     json_ms_per_token=1e3 * json_s / (n_json / args.requests), tokens=(n_free, n_json),
                     check=check(None, free_ok) if not free_ok else check(FORMAT, json_ok)))
    if args.profile:
        import cProfile
        import io
        import pstats
        profiler = cProfile.Profile()
        profiler.runcall(many, FORMAT)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text(text.getvalue())
    engine.close()
    print(f"{args.preset} bf16, {n} tokens a request, a JSON schema with a 3000-3500 character string; decode ms per "
          f"token per request")
    print(f"  {'case':14s} {'free':>8s} {'json':>8s} {'ratio':>6s}  tokens (free, json)  check")
    for r in rows:
        r["ratio"] = r["json_ms_per_token"] / r["free_ms_per_token"]
        print(f"  {r['case']:14s} {r['free_ms_per_token']:8.3f} {r['json_ms_per_token']:8.3f} {r['ratio']:6.2f}  "
              f"{str(r['tokens']):19s} {r['check']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"structured-{args.preset}.json").write_text(json.dumps(dict(argv=sys.argv, rows=rows), indent=1))
    return 0 if all(r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

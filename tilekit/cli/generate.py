"""`tilekit generate`: generate text from a checkpoint of any supported family, streaming it (one GPU, N GPUs
tensor-parallel, or the NumPy reference on the CPU)."""

from __future__ import annotations

import json

from tilekit.cli.common import UsageError, _count, _dtype, _positive, _read_text, _shown, _check_quantize_head


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a checkpoint of any supported family, streaming it")
    _generation_args(gen)
    gen.add_argument("--prompt", help="the text to continue")
    gen.add_argument("--prompts-file", help="a UTF-8 file of prompts, one per line: one batch, each continuation "
                                            "printed as a JSON string on its own line")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the checkpoint's chat template")
    gen.add_argument("--tp", type=_positive,
                     help="split the model over this many GPUs of this host (tensor parallelism; Llama, GPT-2 and "
                          "DeepSeek-V2 families): "
                          "starts one process per GPU; under torchrun (RANK, WORLD_SIZE, ... set) each process is "
                          "one rank and --tp may be left out")


MAX_PROMPTS_BYTES = 16 << 20      # a prompts file of more is refused unread
MAX_FORMAT_BYTES = 1 << 20        # a JSON schema or grammar file of more is refused unread


def _generation_options(args) -> dict:
    """generate()'s options from the command line, each checked (ValueError naming it) before any model loads."""
    from tilekit.engine.sampling import GenerationSettings, SamplingParams
    sampling = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                              "presence_penalty", "frequency_penalty")}
    settings = dict(min_new_tokens=args.min_new_tokens, stop_strings=args.stop or None, seed=args.seed)
    options = dict(sampling, **settings)
    if args.kv_cache_dtype != "auto":
        if args.device != "cuda":
            raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype} needs --device cuda (the NumPy reference keeps "
                             "its cache in float64)")
        options["kv_cache_dtype"] = args.kv_cache_dtype
    checked = {k: v for k, v in options.items() if v is not None}
    SamplingParams(**{k: checked[k] for k in sampling if k in checked})
    GenerationSettings(max_new_tokens=args.max_new_tokens, **{k: checked[k] for k in settings if k in checked})
    response_format = _response_format(args)
    if response_format is not None:
        options["response_format"] = response_format
    return options


def _response_format(args) -> dict | None:
    """Structured output from --json-schema FILE, --json, --regex R or --grammar FILE (at most one), its syntax checked
    before any model loads."""
    given = [(flag, value) for flag, value in (("--json-schema", args.json_schema), ("--json", args.json or None),
                                               ("--regex", args.regex), ("--grammar", args.grammar))
             if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise UsageError(f"give one of --json-schema, --json, --regex and --grammar, not {' and '.join(f for f, _ in given)}")
    flag, value = given[0]
    if flag == "--json-schema":
        text = _read_text(value, flag, MAX_FORMAT_BYTES)
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise UsageError(f"{flag} {_shown(value)} is not JSON: {e}") from None
        fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    elif flag == "--json":
        fmt = {"type": "json_object"}
    elif flag == "--regex":
        fmt = {"type": "regex", "regex": value}
    else:
        fmt = {"type": "grammar", "grammar": _read_text(value, flag, MAX_FORMAT_BYTES)}
    from tilekit.engine.grammar import grammar_of
    try:
        grammar_of(fmt)
    except ValueError as e:
        where = f"{flag} {_shown(value)}" if flag in ("--json-schema", "--grammar") else flag
        raise UsageError(f"{where}: {e}") from None
    return fmt


def _prompts(args) -> list[str]:
    """The prompts of `generate`: --prompt, or --prompts-file (one prompt per line, blank lines skipped)."""
    if (args.prompt is None) == (args.prompts_file is None):
        raise UsageError("generate needs exactly one of --prompt or --prompts-file")
    if args.prompt is not None:
        return [args.prompt]
    lines = [line for line in _read_text(args.prompts_file, "--prompts-file", MAX_PROMPTS_BYTES).splitlines()
             if line.strip()]
    if not lines:
        raise UsageError(f"--prompts-file {_shown(args.prompts_file)} holds no prompt")
    return lines


def _load(args, comm=None):
    """The model of --model on --device: tilekit's on the GPU (`comm`: this tensor-parallel rank's shard), or the
    family's NumPy reference on the CPU."""
    from tilekit.models import families
    if args.device == "cuda":
        from tilekit.device import gpu_unavailable_reason
        reason = gpu_unavailable_reason()
        if reason:   # before loading any weights
            raise UsageError(f"{args.command} needs a GPU: {reason} (--device cpu runs the NumPy reference, slowly)")
        _check_quantize_head(args)
        return families.load_model(args.model, dtype=args.dtype, quantize=args.quantize, comm=comm,
                                   quantize_head=args.quantize_head)
    if args.quantize or args.quantize_head:
        raise UsageError(f"--quantize{'-head' if args.quantize_head and not args.quantize else ''} needs --device "
                         "cuda (the NumPy reference computes in float)")
    return families.load_reference(args.model)


def run(args) -> int:
    options = _generation_options(args)
    prompts = _prompts(args)
    from tilekit import parallel
    dist, start_ranks = parallel.placement(args.tp, args.device == "cuda")
    if start_ranks:
        return parallel.launch(args.tp, args.argv)
    if dist is None:
        return _generate(args, _load(args), prompts, options, print)
    comm = parallel.NcclCommunicator(dist)
    try:
        shown = print if dist.rank == 0 else (lambda *a, **k: None)    # rank 0 prints; every rank computes
        status = _generate(args, _load(args, comm), prompts, options, shown)
    except BaseException:
        comm.close(failed=True)
        raise
    comm.close()
    return status


def _generate(args, model, prompts: list[str], options: dict, show) -> int:
    if len(prompts) == 1:
        echoed = args.chat              # the prompt is echoed with the first piece: after every check has passed

        def stream(piece: str) -> None:
            nonlocal echoed
            if not echoed:
                show(prompts[0], end="", flush=True)
                echoed = True
            show(piece, end="", flush=True)
        model.generate_text(prompts[0], args.max_new_tokens, chat=args.chat, stream_to=stream, **options)
        stream("")
        show()
        return 0
    for text in model.generate_text(prompts, args.max_new_tokens, chat=args.chat, **options):
        show(json.dumps(text, ensure_ascii=False))
    return 0


def _generation_args(p) -> None:
    """The model, device and generation options that `generate` and `chat` share; sampling options left out
    take the checkpoint's generation_config.json values, as Hugging Face's generate does."""
    p.add_argument("--model", required=True, help="checkpoint directory or HF cache name (any supported family, "
                                                  "chosen by config.json's model_type)")
    p.add_argument("--dtype", type=_dtype, default="bfloat16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--quantize", choices=("int8", "fp8"),
                   help="quantize the linears per channel as the weights load (FP8 / INT8 checkpoints load quantized "
                        "without it)")
    p.add_argument("--quantize-head", action="store_true",
                   help="with --quantize: the untied LM head too (Llama and DeepSeek-V2 families; as gpt-fast's int8 "
                        "does)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): tilekit's kernels; cpu: the family's NumPy float64 reference, slow, for "
                        "checking (same options; its own random draws)")
    p.add_argument("--max-new-tokens", type=_count, help="tokens to generate (default: generation_config.json's)")
    p.add_argument("--min-new-tokens", type=_count, help="ban the end-of-sequence ids until this many were made")
    p.add_argument("--temperature", type=float, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=_count, help="sample from the k most likely tokens only (0: off)")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with this total probability")
    p.add_argument("--min-p", type=float, help="keep tokens at least this fraction as likely as the likeliest")
    p.add_argument("--repetition-penalty", type=float, help="Hugging Face's repetition penalty (1: off)")
    p.add_argument("--presence-penalty", type=float, help="subtract this from tokens already generated (0: off)")
    p.add_argument("--frequency-penalty", type=float, help="subtract this per time a token was generated (0: off)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop once the text contains TEXT (repeatable)")
    p.add_argument("--seed", type=_count, help="random seed, for repeatable samples")
    p.add_argument("--json-schema", metavar="FILE", help="structured output: the text is JSON valid against the "
                                                        "JSON schema in FILE")
    p.add_argument("--json", action="store_true", help="structured output: the text is one JSON object")
    p.add_argument("--regex", metavar="R", help="structured output: the text matches the regular expression R")
    p.add_argument("--grammar", metavar="FILE", help="structured output: the text follows the Lark (or GBNF) grammar "
                                                    "in FILE")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="auto (default): keys and values in the model's dtype; fp8: e4m3 codes with per-head scales, "
                        "half the bytes each decode step reads (GPT-2 and Llama families, --device cuda)")

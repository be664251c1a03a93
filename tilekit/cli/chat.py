"""`tilekit chat`: talk with a checkpoint through its chat template, multi-turn, from stdin."""

from __future__ import annotations

import sys

from tilekit.cli.common import UsageError
from tilekit.cli.generate import _generation_args, _generation_options, _load


def add_parser(sub) -> None:
    chat = sub.add_parser("chat", help="talk with a checkpoint through its chat template (multi-turn, from stdin)")
    _generation_args(chat)
    chat.add_argument("--system", help="a system message opening the conversation")


def run(args) -> int:
    """An interactive conversation: each line read is a user turn; the reply streams; an empty line or EOF ends."""
    options = _generation_options(args)
    from tilekit import env
    dist = env.distributed()
    if dist is not None and dist.world_size > 1:
        raise UsageError(f"chat does not run tensor-parallel (WORLD_SIZE={dist.world_size}); use generate --chat")
    model = _load(args)
    model.chat_template()       # a checkpoint without one is refused before the first turn
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = model.chat(messages, args.max_new_tokens, stream_to=lambda s: print(s, end="", flush=True), **options)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})

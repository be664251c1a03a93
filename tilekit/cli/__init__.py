"""The `tilekit` command, one module per subcommand (tune, db, generate, chat, serve), each adding its parser and running
it; common.py holds what they share. No library logic lives here.

The benchmark suite lives in the source checkout: `python -m benchmarks` from its root."""

from __future__ import annotations

import argparse
import os
import sys

from tilekit.cli import chat, db, generate, serve, tune
from tilekit.cli.common import UsageError, _Parser, _shown, _version
from tilekit.untrusted import shown

SUBCOMMANDS = {module.__name__.rpartition(".")[2]: module for module in (tune, db, generate, chat, serve)}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tilekit", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do")
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tilekit.autotune.db import TuningDBError
    from tilekit.parallel import EXIT_PEER_LOST, RankError
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        from tilekit import env
        env.check()          # every TILEKIT_* / HF_* variable, before anything reads one
        if getattr(args, "command", None) in ("tune", "db"):
            import tilekit.kernels  # noqa: F401  (declares the ops that tuning entries name)
        return SUBCOMMANDS[args.command].run(args)     # looked up now: each module's run()
    except (UsageError, ValueError, FileNotFoundError, TuningDBError) as e:
        print(f"tilekit: {shown(str(e), 1 << 20)}", file=sys.stderr)     # one line: a file's newlines escaped
        return 2
    except KeyboardInterrupt:      # Ctrl-C: what was finished is kept (a tune's entries, a chat's printed text)
        print("tilekit: interrupted", file=sys.stderr)
        return 130
    except RankError as e:    # tensor parallelism: another rank missing, dead or disagreeing (its WORLD_SIZE)
        print(f"tilekit: {shown(str(e), 1 << 20)}", file=sys.stderr)
        return EXIT_PEER_LOST
    except BrokenPipeError:   # output piped into `head` and the like: stop quietly (before OSError, its base)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:     # a permission or disk error on a file the command writes or reads
        print(f"tilekit: {_shown(str(e.filename or ''), 400)}: {shown(str(e.strerror or e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

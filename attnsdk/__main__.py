"""``python -m attnsdk info | demo``."""

from __future__ import annotations

import argparse
import sys

from attnsdk._cli import demo, info
from attnsdk._errors import AttnSDKError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnsdk", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="this machine and every backend's availability, with reasons")
    d = sub.add_parser(
        "demo", help="run a mixed batch on the auto-selected backend vs the reference"
    )
    d.add_argument(
        "--backend", default=None, help="backend name (default: $ATTNSDK_BACKEND or auto)"
    )
    d.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            return info()
        return demo(args.backend, args.seed)
    except AttnSDKError as exc:  # a configuration problem is a message, not a traceback
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

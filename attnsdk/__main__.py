"""``attnsdk`` / ``python -m attnsdk``: see ``attnsdk._cli.main`` and docs/cli.md."""

from __future__ import annotations

import sys

from attnsdk._cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main(prog="python -m attnsdk"))

"""``orch`` and ``python -m orch``."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["--version"]:  # answered before the command line's modules load
        from orch_contracts import __version__

        print(f"observer-orchestrator {__version__}")
        return
    from orch.cli import app

    app(prog_name="orch")


if __name__ == "__main__":
    main()

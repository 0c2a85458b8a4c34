"""Entry point of the apply container inside the cycle: /work holds repo/ and out/."""

from __future__ import annotations

import sys
from pathlib import Path

from sandbox.apply import main

if __name__ == "__main__":
    sys.exit(main(in_dir=Path("/in"), repo=Path("/work/repo"), out_dir=Path("/work/out")))

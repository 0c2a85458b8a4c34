"""Shared tail of every benchmark: print the JSON figures and keep them in --out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def report(result: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")

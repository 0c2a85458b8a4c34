"""Training receipts: sha256 of the config, the dataset and every adapter file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def file_sha(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_sha(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): file_sha(p)
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write(out: Path, *, kind: str, config: dict[str, Any], dataset: Path, adapter: Path,
          base_model: Path, extra: dict[str, Any]) -> dict[str, Any]:
    receipt = {
        "schema": 1, "kind": kind,
        "config": config, "config_sha256": hashlib.sha256(canonical(config)).hexdigest(),
        "dataset_sha256": file_sha(dataset),
        "adapter_files": tree_sha(adapter),
        "base_model_files": tree_sha(base_model),
        **extra,
    }
    (out / "train-receipt.json").write_bytes(canonical(receipt))
    return receipt

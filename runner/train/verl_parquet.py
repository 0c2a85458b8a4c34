"""Parquet files in verl's dataset layout, written with pyarrow (host only).

Explicit schemas: a column that is null in every row still has its type, every row of
a file has the same struct shape, and verl 0.9's ``RLHFDataset`` (``datasets`` parquet
reader) and ``MultiTurnSFTDataset`` (``pandas.read_parquet``) read the files as written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
EXTRA_INFO = pa.struct([
    ("index", pa.int64()), ("trajectory_id", pa.string()), ("stage", pa.string()),
    ("case_id", pa.string()), ("trial", pa.int64()), ("split", pa.string()),
    ("mandatory", pa.bool_()), ("turns", pa.int64()), ("r_format", pa.int64()),
    ("r_outcome", pa.float64()), ("r_outcome_basis", pa.string()),
    ("request_sha256", pa.string()), ("last_request_sha256", pa.string()),
    ("last_response_sha256", pa.string()), ("fixture", pa.bool_()),
])
RL_SCHEMA = pa.schema([
    ("data_source", pa.string()), ("prompt", MESSAGES), ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", EXTRA_INFO),
])
SFT_SCHEMA = pa.schema([
    ("data_source", pa.string()), ("messages", MESSAGES), ("extra_info", EXTRA_INFO),
])


def _write(rows: list[dict[str, Any]], schema: pa.Schema, path: Path) -> None:
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path)


def write_rl(rows: list[dict[str, Any]], path: Path) -> None:
    """RL prompts: data_source, prompt, ability, reward_model, extra_info."""
    _write(rows, RL_SCHEMA, path)


def write_sft(rows: list[dict[str, Any]], path: Path) -> None:
    """SFT conversations: data_source, messages (with the assistant turn), extra_info."""
    _write(rows, SFT_SCHEMA, path)

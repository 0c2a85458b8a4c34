"""Parquet files in verl's dataset layout, written with pyarrow (host only).

Explicit schemas: a column that is null in every row still has its type, every row of
a file has the same struct shape, and verl 0.9's ``RLHFDataset`` (``datasets`` parquet
reader) and ``MultiTurnSFTDataset`` (``pandas.read_parquet``) read the files as written.

Messages are chat messages with tool calls kept: ``tool_calls`` (arguments as JSON text,
as on the chat wire) on an assistant turn that called tools, ``tool_call_id`` on a tool
result; both null elsewhere. ``tools`` (the request's tools in chat shape) is a list of
tool objects, which verl's ``MultiTurnSFTDataset`` (``tools_key``) and TRL's ``SFTTrainer``
pass to ``apply_chat_template``. A JSON Schema has no fixed Arrow type, so the column's
type is inferred from the rows, and used only when every row reads back exactly as
written (a struct inferred across different schemas fills missing keys with null, and an
empty object has no Parquet type); otherwise the column holds each row's tools as JSON
text, which TRL reads and verl 0.9 does not (:func:`tools_column` says which).
``tools_json`` always holds the exact JSON text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

TOOL_CALLS = pa.list_(pa.struct([
    ("id", pa.string()), ("type", pa.string()),
    ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
]))
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()),
                               ("tool_calls", TOOL_CALLS), ("tool_call_id", pa.string())]))
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


STRUCT = "struct"
JSON_TEXT = "json_text"
MAX_TOOL_FIELDS = 4096
"""Most struct fields (distinct key paths over all rows) a ``tools`` column is inferred
with; past it the column is JSON text. The schemas are the container's to write, and
Arrow's inference and the Parquet write cost per field: 80 000 property names in one
request (2.5 MB) took 57 s and 2.1 GB of the host's memory, and made 80 000 columns."""


def _field_paths_over(tools: list[list[dict[str, Any]]], most: int) -> bool:
    """Whether the rows' tools hold more than ``most`` distinct key paths (list items
    share their list's path): the struct fields Arrow would infer for them."""
    seen: set[tuple[str, ...]] = set()
    stack: list[tuple[tuple[str, ...], Any]] = [((), tools)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                sub = (*path, str(k))
                if sub not in seen:
                    seen.add(sub)
                    if len(seen) > most:
                        return True
                stack.append((sub, v))
        elif isinstance(value, list):
            stack.extend((path, v) for v in value)
    return False


def tools_column(tools: list[list[dict[str, Any]]]) -> tuple[pa.Array, str]:
    """(column, kind) for the rows' tools: inferred structs when every row reads back
    exactly and they have at most :data:`MAX_TOOL_FIELDS` fields (kind ``struct``), else
    each row's JSON text (kind ``json_text``)."""
    if _field_paths_over(tools, MAX_TOOL_FIELDS):  # checked before Arrow sees one field
        return _json_text(tools), JSON_TEXT
    try:
        arr = pa.array(tools)
        if arr.type.equals(pa.list_(pa.null())):  # no row declares a tool
            arr = pa.array(tools, type=pa.list_(pa.struct([("type", pa.string())])))
        table = pa.table({"tools": arr})
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        back = pq.read_table(pa.BufferReader(buf.getvalue())).column("tools").to_pylist()
        # compared as JSON text: Python's == takes False for 0.0 and 1 for 1.0, so a
        # schema's boolean default read back as a float passed (an attack review)
        if _exact(back) == _exact(tools):
            return arr, STRUCT
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        pass
    return _json_text(tools), JSON_TEXT


def _json_text(tools: list[list[dict[str, Any]]]) -> pa.Array:
    return pa.array([json.dumps(t, ensure_ascii=False) for t in tools], type=pa.string())


def _exact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _write(rows: list[dict[str, Any]], schema: pa.Schema, path: Path) -> str:
    table = pa.Table.from_pylist(rows, schema=schema)
    tools = [r["tools"] for r in rows]
    col, kind = tools_column(tools)
    table = table.append_column("tools", col).append_column(
        "tools_json", pa.array([json.dumps(t, ensure_ascii=False) for t in tools],
                               type=pa.string()))
    pq.write_table(table, path)
    return kind


def write_rl(rows: list[dict[str, Any]], path: Path) -> str:
    """RL prompts: data_source, prompt, ability, reward_model, extra_info, tools,
    tools_json; returns the kind of the tools column."""
    return _write(rows, RL_SCHEMA, path)


def write_sft(rows: list[dict[str, Any]], path: Path) -> str:
    """SFT conversations: data_source, messages (with the assistant turn), extra_info,
    tools, tools_json; returns the kind of the tools column."""
    return _write(rows, SFT_SCHEMA, path)

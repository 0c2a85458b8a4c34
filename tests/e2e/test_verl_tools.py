"""Tool calls reach the trainers: the export of a run whose analyst called tools in all
three API families (tests/fixtures/tool_run.py: exact recorded blobs, streamed and not)
is loaded by verl 0.9.1's MultiTurnSFTDataset with its ``tools`` key and by TRL's
SFTTrainer (conversational rows with a ``tools`` column, ``assistant_only_loss``), which
trains one step on the tiny model, whose chat template renders tools and tool calls and
marks assistant turns with ``{% generation %}``. verl and TRL run in their own virtualenv
(`make verl-env` -> build/verl-venv) as a subprocess; without it these tests fail, never
skip. The tiny model is built there from sandbox/train/tiny.py (no Docker needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from runner.paths import PROJECT_ROOT
from tests.e2e.test_verl import CONSUMER, VERL_PY
from tests.fixtures.tool_run import RESULT, write_tool_run
from tests.unit.test_export import POLICY, _calibration

pytestmark = [pytest.mark.slow]


def in_verl(*args: str, cwd: Path = CONSUMER.parent) -> subprocess.CompletedProcess[str]:
    assert VERL_PY.is_file(), f"{VERL_PY} missing: run `make verl-env` (make test does)"
    res = subprocess.run([str(VERL_PY), *args], capture_output=True, text=True, timeout=900,
                         check=False, cwd=cwd)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def corpus_and_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from runner.train.export import export

    work = tmp_path_factory.mktemp("verl-tools")
    run = write_tool_run(work / "run")
    cal = _calibration(work, "tools", lambda v: v, run=run)
    corpus = work / "corpus"
    summary = export(run, corpus, calibration=cal, policy=POLICY)
    assert summary.sft_rows == 3 and summary.tools_column["sft"] == "struct"
    model = work / "tiny"
    in_verl("-m", "sandbox.train.tiny", "--out", str(model), cwd=PROJECT_ROOT)
    return corpus, model


def test_verl_and_trl_train_on_tool_calls(corpus_and_model: tuple[Path, Path]) -> None:
    corpus, model = corpus_and_model
    res = in_verl(str(CONSUMER), "tools", str(corpus), str(model))
    line = [x for x in res.stdout.splitlines() if x.startswith("VERL-FACTS ")]
    assert len(line) == 1, res.stdout[-3000:]
    facts: dict[str, Any] = json.loads(line[0].removeprefix("VERL-FACTS "))
    # verl: every row loads with its tools; the tool call is learned, the result is not
    assert facts["verl_rows"] == 3 and facts["verl_tools"] == [["query"]] * 3
    for text, learned, n, total in zip(facts["verl_text"], facts["verl_learned"],
                                       facts["verl_loss_tokens"], facts["verl_tokens"],
                                       strict=True):
        assert text.startswith('<|system|>tools: [{"type": "function", "function": '
                               '{"name": "query"'), text
        assert "<tool_call>query {" in text and "SELECT SUM(total) FROM orders" in text
        assert f": {RESULT}<|end|>" in text  # the tool result, after its tool_call_id
        # learned: the tool call and the final answer, each with its end token; never
        # the tools, the question or the tool result
        assert learned.startswith("<tool_call>query {") and learned.count("<|end|>") == 2
        assert "tools:" not in learned and "<|tool|>" not in learned
        assert "revenue" not in learned and 0 < n < total
    # TRL: the same rows, tools column, assistant-only loss, one step
    assert facts["trl_rows"] == 3 and facts["trl_steps"] == 1 and facts["trl_loss_finite"]
    for text, learned, n, total in zip(facts["trl_text"], facts["trl_learned"],
                                       facts["trl_assistant_tokens"], facts["trl_tokens"],
                                       strict=True):
        assert text.startswith("<|system|>tools: ") and "<|tool|>" in text
        assert learned.startswith("<tool_call>query {") and learned.count("<|end|>") == 2
        assert "tools:" not in learned and "<|tool|>" not in learned
        assert "revenue" not in learned
        assert 0 < n < total


ENCODE = """
import json, sys
from transformers import AutoTokenizer
from sandbox.train import lora, sft
rows = sft.rows_from_corpus(__import__("pathlib").Path(sys.argv[1]) / "trajectories.jsonl",
                            include_failed=False)
tok = AutoTokenizer.from_pretrained(sys.argv[2])
out = []
for row in rows:
    enc = lora.encode(tok, row)
    labels = [i for i in enc["labels"][0].tolist() if i != -100]
    out.append({"tools": [t["function"]["name"] for t in row.get("tools") or []],
                "last": row["messages"][-1], "learned": tok.decode(labels)})
print("SFT-ROWS " + json.dumps(out))
"""


def test_train_sft_rows_keep_tool_calls(corpus_and_model: tuple[Path, Path]) -> None:
    """`cyclebox train sft`'s own rows (sandbox.train.sft) and loss mask (lora.encode):
    every passed turn, tool-calling ones included, becomes a row with its tools, and the
    learned tokens are the reply as the template renders it (the tool call itself)."""
    corpus, model = corpus_and_model
    res = in_verl("-c", ENCODE, str(corpus), str(model), cwd=PROJECT_ROOT)
    line = [x for x in res.stdout.splitlines() if x.startswith("SFT-ROWS ")]
    rows: list[dict[str, Any]] = json.loads(line[0].removeprefix("SFT-ROWS "))
    # 3 passed trajectories (chat, responses, messages) x 2 turns: the tool call, the answer
    assert len(rows) == 6 and all(r["tools"] == ["query"] for r in rows)
    calls = [r for r in rows if r["last"].get("tool_calls")]
    assert len(calls) == 3, rows
    for r in calls:
        assert r["learned"].startswith("<tool_call>query {"), r["learned"]
        assert "<|tool|>" not in r["learned"] and "tools:" not in r["learned"]

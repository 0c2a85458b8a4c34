"""Supervised LoRA fine-tuning on an exported corpus (``cyclebox train sft``).

Mounts: /corpus (trajectories.jsonl from ``cyclebox export``), /model, /in/config.json,
/out. Each turn becomes one chat row: the turn's messages in chat shape (tool calls and
tool results kept, whatever API family the agent spoke), then the reply message, with the
request's tools; a row whose text holds one of the tokenizer's special tokens is left
out and counted. By default only trajectories that passed
(``r_outcome == 1``) are learned from; ``include_failed`` in the config takes every graded
and ungraded one. The selection and its counts go in the receipt. The adapter's
``adapter_config.json`` names the base model by the host path the operator passed
(``base_model_host``), so it loads outside the container; the container path is kept
in the receipt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sandbox.train import plan


def outcome_key(value: Any) -> str:
    return "null" if value is None else "1" if value == 1 else "0"


def select(path: Path, *, include_failed: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(trajectories to learn from, selection record with counts by r_outcome)."""
    # JSON Lines end at "\n" alone: a trajectory's text may hold U+2028 or U+0085 raw
    trajs = [json.loads(line) for line in path.read_text().split("\n") if line]
    counts = {"1": 0, "0": 0, "null": 0}
    for t in trajs:
        counts[outcome_key(t.get("r_outcome"))] += 1
    used = trajs if include_failed else [t for t in trajs if t.get("r_outcome") == 1]
    return used, {"include_failed": include_failed, "rule": "every trajectory" if include_failed
                  else "r_outcome == 1", "trajectories": len(trajs), "by_r_outcome": counts,
                  "used": len(used), "left_out": len(trajs) - len(used)}


def rows_from_corpus(path: Path, *, include_failed: bool = True) -> list[dict[str, Any]]:
    return rows_from_trajectories(select(path, include_failed=include_failed)[0])


def control_tokens(tok: Any) -> list[str]:
    """The tokenizer's special tokens and the added tokens that look like markup (``<``,
    ``[`` or ``|`` in them: DeepSeek's turn tokens are added, not special; an added run of
    spaces is not a control token)."""
    special = [t for t in getattr(tok, "all_special_tokens", []) if t]
    added: dict[str, int] = getattr(tok, "get_added_vocab", dict)()
    return sorted({*special, *(t for t in added if len(t) >= 3 and set(t) & set("<[|\uff5c"))})


def special_token_in(row: dict[str, Any], tokens: list[str]) -> bool:
    """Whether a text of the row (messages, tools) holds one of ``tokens``: written in a
    message, the tokenizer reads it as the real token, so a tool result or a reply could
    open turns of its own. Such a row is left out, counted."""
    text = json.dumps(row, ensure_ascii=False)
    return any(t in text for t in tokens)


def rows_from_trajectories(trajs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One chat row per turn with a reply whose call succeeded (status ``ok``): the turn's
    messages in chat shape (tool calls and tool results kept, every API family alike),
    the reply message last, and the request's tools. Corpora written before turns
    carried ``messages`` fall back to the recorded chat request and the reply text."""
    rows = []
    for traj in trajs:
        for turn in traj["turns"]:
            if turn.get("status", "ok") != "ok":
                # a failed call (infra_error: a stream cut short) keeps its partial reply
                # as evidence; the container was answered 502 and the model did not finish
                continue
            reply_msg = turn.get("reply_message")
            if isinstance(turn.get("messages"), list) and isinstance(reply_msg, dict):
                row: dict[str, Any] = {"messages": [*turn["messages"], reply_msg]}
                if turn.get("tools"):
                    row["tools"] = turn["tools"]
                rows.append(row)
                continue
            reply = turn.get("reply")
            if reply is None or not turn.get("prompt"):
                continue
            req = json.loads(turn["prompt"])
            if not isinstance(req, dict) or not isinstance(req.get("messages"), list):
                continue
            msgs = [{"role": m["role"], "content": str(m.get("content") or "")}
                    for m in req["messages"]]
            rows.append({"messages": [*msgs, {"role": "assistant", "content": reply}]})
    return rows


def main(corpus: Path = Path("/corpus"), model_dir: Path = Path("/model"),
         in_dir: Path = Path("/in"), out: Path = Path("/out")) -> int:
    from sandbox.train import lora, receipt

    cfg: dict[str, Any] = json.loads((in_dir / "config.json").read_text())
    used, selection = select(corpus / "trajectories.jsonl",
                             include_failed=bool(cfg.get("include_failed")))
    rows = rows_from_trajectories(used)
    nothing = {"event": "error", "selection": selection,
               "message": "no trajectory with a reply passed the selection "
               "(r_outcome == 1); nothing to train on"}
    if not rows:
        selection["rows"] = 0
        print(json.dumps(nothing))
        return 3
    threads = lora.setup(int(cfg["seed"]))
    model, tok = lora.load(model_dir)
    tokens = control_tokens(tok)
    kept = [r for r in rows if not special_token_in(r, tokens)]
    selection["rows_with_special_tokens"] = len(rows) - len(kept)
    rows = kept
    selection["rows"] = len(rows)
    if not rows:
        print(json.dumps(nothing))
        return 3
    dataset = out / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    sched = plan.base_schedule(len(rows))
    epochs = int(cfg.get("epochs") or sched.epochs)
    lora.emit({"event": "start", "rows": len(rows), "epochs": epochs,
               "grad_accum": sched.grad_accum, "threads": threads})
    peft_model = lora.with_lora(model)
    figures = lora.train(peft_model, tok, rows, epochs=epochs, grad_accum=sched.grad_accum,
                         lr=float(cfg["lr"]), seed=int(cfg["seed"]))
    adapter = out / "adapter"
    peft_model.save_pretrained(adapter)
    host_base = cfg.get("base_model_host")
    if host_base:
        point_adapter_at(adapter, str(host_base))
    receipt.write(out, kind="sft", config={**cfg, "epochs": epochs,
                                           "grad_accum": sched.grad_accum},
                  dataset=dataset, adapter=adapter, base_model=model_dir,
                  extra={"figures": figures, "selection": selection,
                         "base_model": {"host_path": host_base,
                                        "container_path": str(model_dir)},
                         "corpus_sha256": receipt.file_sha(corpus / "trajectories.jsonl")})
    lora.emit({"event": "done", **figures})
    return 0


def point_adapter_at(adapter: Path, base: str) -> None:
    """Name ``base`` (the host's model directory) as the adapter's base model, so
    ``AutoPeftModelForCausalLM.from_pretrained(adapter)`` works where the operator is."""
    cfg_file = adapter / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["base_model_name_or_path"] = base
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())

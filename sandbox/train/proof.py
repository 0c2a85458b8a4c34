"""The proof loop (SPEC §9) in the trainer container: persona rows, schedule from the
ledger, LoRA training, recall before/after, imprint, classroom, board, ledger row,
training receipt. Exit 4 when nothing imprinted.

Mounts: /in (persona.json, ledger.jsonl, config.json), /model (base model), /out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sandbox.train import plan


def main(in_dir: Path = Path("/in"), model_dir: Path = Path("/model"),
         out: Path = Path("/out")) -> int:
    from sandbox.train import lora, receipt

    persona: dict[str, Any] = json.loads((in_dir / "persona.json").read_text())
    cfg: dict[str, Any] = json.loads((in_dir / "config.json").read_text())
    ledger_file = in_dir / "ledger.jsonl"
    ledger = [json.loads(x) for x in ledger_file.read_text().split("\n") if x.strip()] \
        if ledger_file.exists() else []
    rows = plan.rows_from_persona(persona)
    dataset = out / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    sched = plan.nudge(plan.base_schedule(len(rows)), plan.last_row(ledger, persona["name"]))
    threads = lora.setup(int(cfg["seed"]))
    lora.emit({"event": "start", "rows": len(rows), "epochs": sched.epochs,
               "grad_accum": sched.grad_accum, "threads": threads, "reason": sched.reason})
    model, tok = lora.load(model_dir)
    system = str(persona.get("system", ""))
    probes = [(str(e["user"]), str(e["assistant"])) for e in persona.get("exchanges", [])]
    max_new = int(cfg.get("max_new_tokens", 48))
    before = [lora.generate(model, tok, system, q, max_new) for q, _ in probes]
    peft_model = lora.with_lora(model)
    figures = lora.train(peft_model, tok, rows, epochs=sched.epochs, grad_accum=sched.grad_accum,
                         lr=float(cfg["lr"]), seed=int(cfg["seed"]))
    after = [lora.generate(peft_model, tok, system, q, max_new) for q, _ in probes]
    refs = [a for _, a in probes]
    scores = plan.imprint(before, after, refs)
    recall_before, recall_after = plan.recall(before, refs), plan.recall(after, refs)
    passed = plan.classroom(scores)
    board = plan.board(scores, recall_after, after)
    adapter = out / "adapter"
    peft_model.save_pretrained(adapter)
    ledger_row = {"persona": persona["name"], "passed": passed, "rows": len(rows),
                  "epochs": sched.epochs, "grad_accum": sched.grad_accum,
                  "imprint_delta": scores["imprint_delta"], "recall_before": recall_before,
                  "recall_after": recall_after, "board": board["decision"]}
    (out / "ledger-row.json").write_text(json.dumps(ledger_row, sort_keys=True))
    report = {"persona": persona["name"], "schedule": sched.__dict__, "figures": figures,
              "probes": [q for q, _ in probes], "references": refs, "before": before,
              "after": after, "recall_before": recall_before, "recall_after": recall_after,
              "scores": scores, "classroom_passed": passed, "board": board}
    (out / "report.json").write_text(json.dumps(report, sort_keys=True, indent=1))
    config = {**cfg, "schedule": sched.__dict__, "lora": {"r": 16, "alpha": 32,
                                                           "target_modules": lora.TARGET_MODULES}}
    receipt.write(out, kind="proof", config=config, dataset=dataset, adapter=adapter,
                  base_model=model_dir, extra={"recall_before": recall_before,
                                               "recall_after": recall_after, "scores": scores,
                                               "classroom_passed": passed,
                                               "board": board["decision"]})
    lora.emit({"event": "done", "recall_before": recall_before, "recall_after": recall_after,
               "imprint_delta": scores["imprint_delta"], "passed": passed,
               "board": board["decision"]})
    return 0 if passed else 4


if __name__ == "__main__":
    sys.exit(main())

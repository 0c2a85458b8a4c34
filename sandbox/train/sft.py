"""Supervised LoRA fine-tuning on an exported corpus (``cyclebox train sft``).

Mounts: /corpus (trajectories.jsonl from ``cyclebox export``), /model, /in/config.json,
/out. Each turn becomes one chat row: the recorded request's messages, then the
recorded reply as the assistant message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sandbox.train import plan


def rows_from_corpus(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        traj = json.loads(line)
        for turn in traj["turns"]:
            req = json.loads(turn["prompt"])
            reply = turn.get("reply")
            if reply is None:
                continue
            msgs = [{"role": m["role"], "content": str(m.get("content") or "")}
                    for m in req["messages"]]
            rows.append({"messages": [*msgs, {"role": "assistant", "content": reply}]})
    return rows


def main(corpus: Path = Path("/corpus"), model_dir: Path = Path("/model"),
         in_dir: Path = Path("/in"), out: Path = Path("/out")) -> int:
    from sandbox.train import lora, receipt

    cfg: dict[str, Any] = json.loads((in_dir / "config.json").read_text())
    rows = rows_from_corpus(corpus / "trajectories.jsonl")
    if not rows:
        print(json.dumps({"event": "error", "message": "corpus has no replies to train on"}))
        return 3
    dataset = out / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    sched = plan.base_schedule(len(rows))
    epochs = int(cfg.get("epochs") or sched.epochs)
    threads = lora.setup(int(cfg["seed"]))
    lora.emit({"event": "start", "rows": len(rows), "epochs": epochs,
               "grad_accum": sched.grad_accum, "threads": threads})
    model, tok = lora.load(model_dir)
    peft_model = lora.with_lora(model)
    figures = lora.train(peft_model, tok, rows, epochs=epochs, grad_accum=sched.grad_accum,
                         lr=float(cfg["lr"]), seed=int(cfg["seed"]))
    adapter = out / "adapter"
    peft_model.save_pretrained(adapter)
    receipt.write(out, kind="sft", config={**cfg, "epochs": epochs,
                                           "grad_accum": sched.grad_accum},
                  dataset=dataset, adapter=adapter, base_model=model_dir,
                  extra={"figures": figures, "corpus_sha256": receipt.file_sha(
                      corpus / "trajectories.jsonl")})
    lora.emit({"event": "done", **figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())

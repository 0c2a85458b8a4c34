"""Training figures: LoRA vs full fine-tuning of the tiny model, in one trainer-container run
(each mode in its own process, alternated three times, medians): training tokens/s, peak
RSS, trainable parameters, and the adapter's size vs the model's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench._report import report
from runner.cli.train import _trainer
from runner.isolation.sandbox import Mount
from runner.paths import PROJECT_ROOT
from runner.train.host import make_tiny, run_trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cbx-bench-train-"))
    try:
        trainer = _trainer()
        make_tiny(trainer, work / "model", lambda _e: None)
        (work / "in").mkdir(mode=0o755)
        persona = yaml.safe_load((PROJECT_ROOT / "examples/persona/captain.yaml").read_text())
        (work / "in" / "persona.json").write_text(json.dumps(persona))
        (work / "in" / "persona.json").chmod(0o644)
        out = trainer.fresh_output(work / "out")
        got: dict[str, Any] = {}
        rec = run_trainer(trainer, "sandbox.train.bench", out=out, run_id="bench-train",
                          on_event=got.update,
                          mounts=[Mount(source=work / "model", target="/model"),
                                  Mount(source=work / "in", target="/in")])
        if rec.stop_reason.value != "ok":
            raise SystemExit(f"trainer failed: {rec.stderr_tail[-1000:]}")
        lora, full = got["lora"], got["full"]
        result = {
            "bench": "train", "model": "tiny (cyclebox model tiny)", "epochs": 8,
            "lora": lora, "full": full,
            "model_bytes": got["model_bytes"]["bytes"],
            "adapter_bytes": lora["saved_bytes"],
            "adapter_over_model": round(lora["saved_bytes"] / got["model_bytes"]["bytes"], 4),
            "lora_over_full_tokens_per_s": round(lora["tokens_per_s_median"]
                                                 / full["tokens_per_s_median"], 3),
            "lora_over_full_peak_rss": round(lora["peak_rss_mb_median"]
                                             / full["peak_rss_mb_median"], 3),
        }
        report(result, a.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Benchmark inside the trainer container: LoRA vs full fine-tuning of the same model on
the same rows; tokens/s and peak RSS per mode (each mode in its own process, alternated),
adapter size vs model size. Used by bench/train.py."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path


def one(mode: str, model_dir: Path, persona: Path, out: Path) -> dict[str, object]:
    from sandbox.train import lora, plan

    rows = plan.rows_from_persona(json.loads(persona.read_text()))
    lora.setup(0)
    model, tok = lora.load(model_dir)
    if mode == "lora":
        model = lora.with_lora(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fig = lora.train(model, tok, rows, epochs=8, grad_accum=1,
                     lr=5e-3 if mode == "lora" else 1e-3, seed=0, on_event=lambda _e: None)
    target = out / mode
    model.save_pretrained(target)
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    return {**fig, "trainable_params": trainable, "saved_bytes": size}


def main() -> int:
    if len(sys.argv) > 1:
        mode = sys.argv[1]
        print(json.dumps(one(mode, Path("/model"), Path("/in/persona.json"), Path("/out"))))
        return 0
    runs: dict[str, list[dict[str, object]]] = {"lora": [], "full": []}
    for _ in range(3):
        for mode in ("lora", "full"):
            res = subprocess.run([sys.executable, "-m", "sandbox.train.bench", mode],
                                 capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
    model_bytes = sum(p.stat().st_size for p in Path("/model").rglob("*") if p.is_file())
    out = {}
    for mode, rs in runs.items():
        out[mode] = {"tokens_per_s_median": statistics.median(float(r["tokens_per_s"])  # type: ignore[arg-type]
                                                              for r in rs),
                     "peak_rss_mb_median": statistics.median(float(r["peak_rss_mb"])  # type: ignore[arg-type]
                                                             for r in rs),
                     "trainable_params": rs[0]["trainable_params"],
                     "saved_bytes": rs[0]["saved_bytes"], "train_tokens": rs[0]["train_tokens"]}
    out["model_bytes"] = {"bytes": model_bytes}
    print(json.dumps({"event": "bench", **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

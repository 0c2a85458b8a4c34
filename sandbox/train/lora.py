"""Supervised LoRA fine-tuning on CPU with transformers + peft (trainer container only).

fp32, seeded, threads matched to the container's CPU quota, loss only on the
assistant's tokens, progress reported as JSON events on stdout.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Event = Callable[[dict[str, Any]], None]
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event, sort_keys=True), flush=True)


def cpu_quota() -> int:
    """Whole CPUs granted by the cgroup (v1 or v2); the visible count when unlimited."""
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        try:
            q, p = Path("/sys/fs/cgroup/cpu.max").read_text().split()
            quota, period = (-1 if q == "max" else int(q)), int(p)
        except (OSError, ValueError):
            quota, period = -1, 1
    visible = os.cpu_count() or 1
    return visible if quota <= 0 else max(1, min(visible, quota // period))


def setup(seed: int) -> int:
    threads = cpu_quota()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    random.seed(seed)
    return threads


def load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 torch_dtype=torch.float32)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def encode(tok: Any, row: dict[str, Any], max_len: int = 512) -> dict[str, torch.Tensor]:
    """Token ids with labels only on the assistant reply (its text or its tool calls, as
    the model's chat template renders them); long prompts lose their head."""
    msgs, tools = row["messages"], row.get("tools") or None
    prompt = tok.apply_chat_template(msgs[:-1], tools=tools, tokenize=False,
                                     add_generation_prompt=True)
    full = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    if full.startswith(prompt) and len(full) > len(prompt):
        reply = full[len(prompt):]
    else:  # a template whose prompt is not a prefix of the whole: the reply's text
        reply = str(msgs[-1].get("content") or "") + tok.eos_token
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tok(reply, add_special_tokens=False)["input_ids"]
    a_ids = a_ids[: max_len // 2]
    p_ids = p_ids[-(max_len - len(a_ids)):]
    ids = p_ids + a_ids
    labels = [-100] * len(p_ids) + a_ids
    return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])}


def with_lora(model: Any, r: int = 16, alpha: int = 32) -> Any:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGET_MODULES, lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def train(model: Any, tok: Any, rows: list[dict[str, Any]], *, epochs: int, grad_accum: int,
          lr: float, seed: int, on_event: Event = emit) -> dict[str, Any]:
    """Train in place; returns figures (steps, tokens/s, final loss, peak RSS)."""
    encoded = [encode(tok, r) for r in rows]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = random.Random(seed)  # noqa: S311 - seeded data order, not security
    total = epochs * math.ceil(len(encoded) / grad_accum)
    step, tokens, loss_v = 0, 0, float("nan")
    model.train()
    t0 = time.perf_counter()
    for epoch in range(epochs):
        order = list(range(len(encoded)))
        rng.shuffle(order)
        for i, idx in enumerate(order):
            batch = encoded[idx]
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            (out.loss / grad_accum).backward()
            tokens += int(batch["input_ids"].numel())
            loss_v = float(out.loss.detach())
            if (i + 1) % grad_accum == 0 or i == len(order) - 1:
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if step % 10 == 0 or step == total:
                    on_event({"event": "progress", "step": step, "total": total,
                              "epoch": epoch + 1, "loss": round(loss_v, 4)})
    seconds = time.perf_counter() - t0
    model.eval()
    return {"steps": step, "epochs": epochs, "grad_accum": grad_accum, "lr": lr,
            "train_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "final_loss": round(loss_v, 4),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


@torch.no_grad()
def generate(model: Any, tok: Any, system: str, user: str, max_new_tokens: int = 48) -> str:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return str(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)).strip()

"""Run by the verl virtualenv's python (build/verl-venv), never imported by pytest: load a
cyclebox export with verl's own dataset classes, or load a trained adapter with peft.

    python verl_consumer.py datasets CORPUS TOKENIZER_DIR   -> JSON facts on stdout
    python verl_consumer.py adapter ADAPTER_DIR PROMPT     -> JSON facts on stdout
    python verl_consumer.py tools CORPUS MODEL_DIR         -> JSON facts on stdout
        (verl's MultiTurnSFTDataset with tools, then TRL's SFTTrainer, conversational rows
        with a tools column and assistant_only_loss, one training step)

Facts, not verdicts: the test decides what must hold.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def datasets(corpus: Path, tokenizer_dir: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    with tempfile.TemporaryDirectory() as cache:
        rl = RLHFDataset(data_files=[str(corpus / "rl.parquet")], tokenizer=tok,
                         config={"cache_dir": cache, "max_prompt_length": 1 << 16,
                                 "filter_overlong_prompts": True,
                                 "filter_overlong_prompts_workers": 1})
        rl_items = [rl[i] for i in range(len(rl))]
    sft = MultiTurnSFTDataset(parquet_files=[str(corpus / "sft.parquet")], tokenizer=tok,
                              config={"max_length": 1 << 16, "truncation": "error",
                                      "pad_mode": "no_padding"})
    sft_items = [sft[i] for i in range(len(sft))]
    return {
        "rl_file_rows": pq.read_metadata(corpus / "rl.parquet").num_rows,
        "rl_loaded": len(rl),
        "rl_roles": [[m["role"] for m in it["raw_prompt"]] for it in rl_items],
        "rl_index": [int(it["index"]) for it in rl_items],
        "rl_ground_truth": [it["reward_model"]["ground_truth"] for it in rl_items],
        "rl_r_outcome": [it["extra_info"]["r_outcome"] for it in rl_items],
        "rl_request_sha256": [it["extra_info"]["request_sha256"] for it in rl_items],
        "rl_data_source": sorted({it["data_source"] for it in rl_items}),
        "sft_file_rows": pq.read_metadata(corpus / "sft.parquet").num_rows,
        "sft_loaded": len(sft),
        "sft_roles": [[m["role"] for m in sft.messages[i]] for i in range(len(sft))],
        "sft_loss_tokens": [int(it["loss_mask"].sum()) for it in sft_items],
        "sft_tokens": [int(it["input_ids"].numel()) for it in sft_items],
    }


def adapter(adapter_dir: Path, prompt: str) -> dict[str, Any]:
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir))
    tok = AutoTokenizer.from_pretrained(cfg["base_model_name_or_path"])
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {"base_model_name_or_path": cfg["base_model_name_or_path"],
            "class": type(model).__name__, "logits_shape": list(logits.shape),
            "finite": bool(torch.isfinite(logits).all())}


def tools(corpus: Path, model_dir: Path) -> dict[str, Any]:
    import math

    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    sft = MultiTurnSFTDataset(parquet_files=[str(corpus / "sft.parquet")], tokenizer=tok,
                              config={"max_length": 1 << 16, "truncation": "error",
                                      "pad_mode": "no_padding", "tools_key": "tools"})
    items = [sft[i] for i in range(len(sft))]
    learned = [tok.decode(it["input_ids"][it["loss_mask"].bool()]) for it in items]
    facts: dict[str, Any] = {
        "verl_rows": len(sft),
        "verl_tools": [[t["function"]["name"] for t in (sft.tools[i] or [])]
                       for i in range(len(sft))],
        "verl_text": [tok.decode(it["input_ids"]) for it in items],
        "verl_learned": learned,
        "verl_loss_tokens": [int(it["loss_mask"].sum()) for it in items],
        "verl_tokens": [int(it["input_ids"].numel()) for it in items],
    }
    ds = load_dataset("parquet", data_files=str(corpus / "sft.parquet"), split="train")
    ds = ds.select_columns(["messages", "tools"])
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, max_steps=1, per_device_train_batch_size=len(ds),
                         learning_rate=1e-3, assistant_only_loss=True, use_cpu=True,
                         report_to=[], save_strategy="no", logging_steps=1, seed=0,
                         dataset_num_proc=None)
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
        tokenized = trainer.train_dataset
        # TRL turns the assistant mask into labels (-100 where no loss is taken)
        masks = [sum(x != -100 for x in r["labels"]) for r in tokenized]
        trl_learned = [tok.decode([x for x in r["labels"] if x != -100]) for r in tokenized]
        result = trainer.train()
    facts.update({
        "trl_rows": len(tokenized),
        "trl_assistant_tokens": masks,
        "trl_tokens": [len(r["input_ids"]) for r in tokenized],
        "trl_learned": trl_learned,
        "trl_text": [tok.decode(r["input_ids"]) for r in tokenized],
        "trl_steps": int(result.global_step),
        "trl_loss_finite": math.isfinite(float(result.training_loss)),
    })
    return facts


def main(argv: list[str]) -> int:
    mode, a, b = argv
    if mode == "tools":
        facts = tools(Path(a), Path(b))
    else:
        facts = datasets(Path(a), Path(b)) if mode == "datasets" else adapter(Path(a), b)
    print("VERL-FACTS " + json.dumps(facts, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

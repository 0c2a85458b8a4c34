"""Create a tiny Llama-style causal LM and a BPE tokenizer, offline, with save_pretrained.

Runs in the trainer container (``cyclebox model tiny``). The tokenizer is trained
with ``tokenizers`` on the bundled corpus (byte-level, so any text encodes); the
model has random weights from a fixed seed. Any transformers code can load both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    # Tools (chat-completions shape) first, as a system turn; each message then renders
    # alone, so rendering messages one by one and joining equals rendering them together
    # (verl's MultiTurnSFTDataset checks it). An assistant turn, tool calls and its end
    # token included, sits inside {% generation %} so TRL's assistant_only_loss trains it.
    "{% if tools %}<|system|>tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}{% for tc in m['tool_calls'] %}<tool_call>"
    "{{ tc['function']['name'] }} "
    "{% if tc['function']['arguments'] is string %}{{ tc['function']['arguments'] }}"
    "{% else %}{{ tc['function']['arguments'] | tojson }}{% endif %}</tool_call>"
    "{% endfor %}{% endif %}<|end|>{% endgeneration %}"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['tool_call_id'] or '' }}: "
    "{{ m['content'] or '' }}<|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] or '' }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def build(out: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2,
          vocab_size: int = 512, init_range: float = 0.2) -> dict[str, object]:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    text = (Path(__file__).with_name("corpus.txt")).read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",  # noqa: S106
                                   bos_token="<|bos|>", eos_token="<|end|>")  # noqa: S106
    fast.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=512, pad_token_id=fast.pad_token_id,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         tie_word_embeddings=False, initializer_range=init_range)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    info = {"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(fast),
            "hidden": hidden, "layers": layers, "seed": seed}
    (out / "cyclebox-tiny.json").write_text(json.dumps(info, sort_keys=True))
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sandbox.train.tiny")
    ap.add_argument("--out", type=Path, default=Path("/out/model"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(json.dumps({"event": "done", **build(a.out, seed=a.seed)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training code that runs only inside the trainer container (torch, transformers, peft).

``plan`` is pure Python (no torch) so the host can unit-test epoch derivation,
feedback nudging and scoring; the other modules import torch lazily.
"""

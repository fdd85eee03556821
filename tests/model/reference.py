"""Hugging Face transformers as the reference implementation, and prompts of chosen lengths."""

from __future__ import annotations

import torch

TEXT = (
    "The history of computing is a story of abstractions stacked on abstractions. Early machines were "
    "programmed by rewiring panels; then came stored programs, assemblers, compilers and operating systems. "
    "Each layer hid the details of the one below, letting people think about bigger problems. Networks joined "
    "machines together, and the web joined people. Today large language models are trained on much of that "
    "written record, and serving them efficiently has become an engineering discipline of its own: batching "
    "requests, caching attention keys and values in paged memory, and splitting the compute-heavy prompt phase "
    "from the memory-bound generation phase. Good systems measure before they optimise, keep their invariants "
    "simple, and fail loudly rather than silently. "
)


class Reference:
    def __init__(self, model_path: str) -> None:
        """transformers on the model's Hugging Face folder (bench.hf_export, kept in the disk cache):
        reading the GGUF through transformers took 31 s a session on a slow 2-core machine (the
        model 24 s, the tokenizer 7.5 s), the folder under a second. That the two give the same weights is tests/model/test_architectures.py's
        test_hf_folder_and_gguf_give_the_same_weights, and that the folder holds what the workers
        load is tests/bench/test_hf_export.py's."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from bench.hf_export import hf_checkpoint

        folder = hf_checkpoint(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.corpus = self.tokenizer(TEXT * 40, add_special_tokens=False).input_ids

    def prompt(self, length: int, offset: int = 0) -> list[int]:
        start = (offset * 37) % 400
        return self.corpus[start : start + length]

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=self.tokenizer.eos_token_id,
        )
        return out[0, len(prompt_ids):].tolist()

    @torch.inference_mode()
    def last_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([prompt_ids])).logits[0, -1].float()

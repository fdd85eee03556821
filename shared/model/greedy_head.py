"""Greedy tokens straight from the last hidden states, without the logits (CPU, float32).

A batch of plain greedy rows needs only each row's first largest logit. Computed whole, a wide
batch's logits are tens of MB (256 rows of a 49k vocabulary: 50 MB), written by the LM head and
read back by the argmax; on a thin head (hidden size 64) storing them takes longer than the
products. kernels/greedy_head.py keeps each tile of logits in registers and folds it into the rows'
running maxima at once, over a copy of the head's weight packed for it on first use.

On a 2-core Zen 4, hidden size 64 and a 49,152-token vocabulary, 128 rows: 7.3 ms on one thread
and 3.9 on two, where the vocabulary by slices of 2,048 (an MKL product, then an argmax over each
slice) took 12.1 and 8.9 ms and the whole logits 22; at hidden size 576, 256 rows, one thread: 148
ms, against 191 by slices and 243 whole.

It needs the head's weight as a plain tensor: where the LM head is the embedding table (tied
embeddings), the model holds one anyway; an untied head is only packed for oneDNN. float32 only;
bfloat16 heads keep oneDNN's kernels. The reference is the argmax of the whole logits
(`Sampler.greedy`).
"""

from __future__ import annotations

import torch

from kernels import greedy_head
from shared.model.llama import LlamaModel


class GreedyHead:
    def __init__(self, weight: torch.Tensor) -> None:
        """`weight`: the LM head's, float32 [vocab, hidden] on the CPU; packed into a copy of its size
        on first use, since only batches wider than the runner's `greedy_chunk_rows` come here (40-90
        ms for the 135M model's 49,152 x 576, 113 MB)."""
        self._weight = weight
        self._packed: greedy_head.PackedHead | None = None

    @classmethod
    def for_model(cls, model: LlamaModel) -> GreedyHead | None:
        """The model's greedy head where it applies (see the module's docstring), else None."""
        if model.device.type != "cpu" or model.dtype != torch.float32 or not model.config.tie_word_embeddings:
            return None
        if greedy_head.load() is None:
            return None
        return cls(model.embed_tokens)

    def greedy(self, hidden: torch.Tensor) -> list[int]:
        """The first index of each row's largest logit; hidden: float32 [rows, hidden]."""
        if self._packed is None:
            self._packed = greedy_head.PackedHead(self._weight)
        ids = self._packed.argmax(hidden)
        broken = (ids < 0).nonzero().flatten()
        if len(broken):  # no logit above -inf (NaN or -inf only): what torch's max gives such a row
            ids[broken] = greedy_head.reference_argmax(hidden[broken], self._weight)
        return ids.tolist()

"""Greedy tokens straight from the last hidden states, one slice of the vocabulary at a time (CPU, float32).

A batch of plain greedy rows needs only each row's first largest logit. Computed whole, a wide
batch's logits are tens of MB (256 rows of a 49k vocabulary: 50 MB), written by the LM head and
read back by the argmax from memory; in chunks of rows, the head's weight is read again for every
chunk instead. Here every row of the batch meets one slice of VOCAB_SLICE rows of the weight at a
time, and the slice's logits, small enough to stay in the core's cache, are folded into each row's
running maximum by `argmax_fold` (kernels/gumbel_argmax.py) before the next slice overwrites them.

On a 2-core Xeon, in a decode step of 128 requests on the tiny model of `make bench-overhead`
(hidden 64, vocabulary 49,152), one thread: 19.5 ms for the head and the argmax in chunks of 64
rows, 10.3 ms by slices of 2,048 (1,024 and 4,096 within 0.6 ms of it), the same tokens.

It needs the head's weight as a plain tensor: where the LM head is the embedding table (tied
embeddings), the model holds one anyway; an untied head is only packed for oneDNN, and a second
copy would cost its whole size. float32 only: the slices' products run on MKL's sgemm, as the
reference's (transformers') head does; bfloat16 heads keep oneDNN's kernels. The reference is the
argmax of the whole logits (`Sampler.greedy`).
"""

from __future__ import annotations

import math

import torch

from kernels import gumbel_argmax
from shared.model.llama import LlamaModel

VOCAB_SLICE = 2048
# fewer rows take the whole logits: their logits stay in cache anyway, and slicing adds two calls per slice
MIN_ROWS = 16


class SlicedGreedyHead:
    def __init__(self, weight: torch.Tensor) -> None:
        """`weight`: the LM head's, float32 [vocab, hidden] on the CPU, contiguous."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 \
                or not weight.is_contiguous():
            raise ValueError(f"the sliced greedy head takes a contiguous float32 [vocab, hidden] weight on the CPU, "
                             f"got {weight.dtype} {list(weight.shape)} on {weight.device}")
        self._weight = weight
        self._slices = [(start, weight[start:start + VOCAB_SLICE].t()) for start in range(0, weight.shape[0], VOCAB_SLICE)]

    @classmethod
    def for_model(cls, model: LlamaModel) -> SlicedGreedyHead | None:
        """The model's sliced head where it applies (see the module's docstring), else None."""
        if model.device.type != "cpu" or model.dtype != torch.float32 or not model.config.tie_word_embeddings:
            return None
        if gumbel_argmax.load() is None:
            return None
        return cls(model.embed_tokens)

    def greedy(self, hidden: torch.Tensor) -> list[int]:
        """The first index of each row's largest logit; hidden: float32 [rows, hidden]."""
        rows = hidden.shape[0]
        best = torch.full((rows,), -math.inf)
        ids = torch.full((rows,), -1, dtype=torch.int64)
        for start, weight_t in self._slices:
            gumbel_argmax.argmax_fold(best, ids, torch.mm(hidden, weight_t), start)
        broken = (ids < 0).nonzero().flatten()
        if len(broken):  # no logit above -inf (NaN or -inf only): what torch's max gives such a row
            ids[broken] = torch.mm(hidden[broken], self._weight.t()).max(dim=-1).indices
        return ids.tolist()

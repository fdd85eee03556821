"""Turns one step's logits into next tokens: penalties, filters, seeded sampling, logprobs.

Order (vLLM's): raw logprobs -> allowed-token masks (structured output) -> min_tokens and
penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> Gumbel-max with noise
that is a pure function of (seed, position, vocab index), so a seeded row samples the same token
whatever shares its batch and on whichever worker it runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from kernels import gumbel_argmax as gumbel_kernel
from shared.engine.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9
_VOCAB_SALT = 0x85EBCA6B
# Top-p looks for its cut among this many most likely tokens first and sorts the whole
# vocabulary only for rows whose nucleus is larger (flat distributions).
_TOP_P_CANDIDATES = 1024
# Noise is drawn only for the finite scores when at most 1/8 of the vocabulary is left.
_SPARSE_NOISE_RATIO = 8


@dataclass(slots=True)
class SamplingInput:
    """One row of the batch. `seed` is params.seed or one the engine drew at admission."""

    params: SamplingParams
    seed: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class RowValues:
    """A per-row parameter for only the rows that use it."""

    row_ids: Tensor  # [num_using] int64, rows of the tensor it applies to
    values: Tensor  # [num_using]


@dataclass(slots=True)
class Penalties:
    row_ids: Tensor  # [num_penalized] int64
    repetition: Tensor | None  # [num_penalized, vocab] penalty on tokens in prompt or output, else 1
    offset: Tensor | None  # [num_penalized, vocab] presence * (count > 0) + frequency * count over output


@dataclass(slots=True)
class RandomRows:
    """The rows that sample; the row ids of the filters index these rows, not the batch."""

    row_ids: Tensor  # [num_random] int64, rows of the batch
    temperature: Tensor  # [num_random, 1]
    keys: Tensor  # [num_random] int64 holding uint32 keys of (seed, position)
    top_k: RowValues | None
    max_top_k: int
    top_p: RowValues | None
    log_min_p: RowValues | None


@dataclass(slots=True)
class SamplingBatch:
    num_rows: int
    vocab_size: int
    greedy_row_ids: Tensor | None  # [num_greedy]; None when no row or every row is greedy
    random: RandomRows | None
    penalties: Penalties | None
    banned: RowValues | None  # (row, token id) pairs that min_tokens sets to -inf
    num_logprobs: list[int | None] | None  # None when no row asked for logprobs
    # when a row is under a grammar: int32 bitmask [num_rows, ceil(vocab / 32)], bit j of word w allows token 32w + j
    allowed: Tensor | None = None

    @property
    def is_plain_greedy(self) -> bool:
        return (self.random is None and self.penalties is None and self.banned is None and self.num_logprobs is None
                and self.allowed is None)


@dataclass(slots=True)
class SamplerOutput:
    """`logprobs` holds the raw logprob of every row's token when any row asked for logprobs;
    `top_logprobs[i]` holds row i's `params.logprobs` best (token_id, logprob), [] if it asked none."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def build_sampling_batch(
    rows: Sequence[SamplingInput],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device | str,
    token_masks: Tensor | None = None,
) -> SamplingBatch:
    """`token_masks`: every row's allowed tokens as a bitmask, when a row is under a grammar
    (shared/engine/structured.py)."""
    random_ids = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    greedy_ids = [i for i, row in enumerate(rows) if row.params.is_greedy]
    wants_logprobs = any(row.params.logprobs is not None for row in rows)
    return SamplingBatch(
        num_rows=len(rows),
        vocab_size=vocab_size,
        greedy_row_ids=_long(greedy_ids, device) if random_ids and greedy_ids else None,
        random=_random_rows(rows, random_ids, vocab_size, device) if random_ids else None,
        penalties=_penalties(rows, vocab_size, device),
        banned=_banned(rows, eos_token_ids, vocab_size, device),
        num_logprobs=[row.params.logprobs for row in rows] if wants_logprobs else None,
        allowed=None if token_masks is None else token_masks.to(device),
    )


def _long(values: Sequence[int], device: torch.device | str) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: Sequence[float], device: torch.device | str) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _row_values(values: Sequence[float | None], dtype: torch.dtype, device: torch.device | str) -> RowValues | None:
    used = [(i, v) for i, v in enumerate(values) if v is not None]
    if not used:
        return None
    values = torch.tensor([v for _, v in used], dtype=dtype, device=device)
    return RowValues(_long([i for i, _ in used], device), values)


def _random_rows(
    rows: Sequence[SamplingInput], random_ids: list[int], vocab_size: int, device: torch.device | str
) -> RandomRows:
    params = [rows[i].params for i in random_ids]
    top_ks = [p.top_k if p.top_k is not None and p.top_k < vocab_size else None for p in params]
    seeds = [rows[i].seed & (2**64 - 1) for i in random_ids]
    return RandomRows(
        row_ids=_long(random_ids, device),
        temperature=_float([p.temperature for p in params], device).unsqueeze(1),
        keys=row_keys(
            _long([s & _MASK32 for s in seeds], device),
            _long([s >> 32 for s in seeds], device),
            _long([len(rows[i].output_token_ids) & _MASK32 for i in random_ids], device),
        ),
        top_k=_row_values(top_ks, torch.long, device),
        max_top_k=max((k for k in top_ks if k is not None), default=0),
        top_p=_row_values([p.top_p if p.top_p < 1.0 else None for p in params], torch.float32, device),
        log_min_p=_row_values([math.log(p.min_p) if p.min_p > 0.0 else None for p in params], torch.float32, device),
    )


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _penalties(rows: Sequence[SamplingInput], vocab_size: int, device: torch.device | str) -> Penalties | None:
    row_ids = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    if not row_ids:
        return None
    params = [rows[i].params for i in row_ids]
    output_counts = _token_counts([rows[i].output_token_ids for i in row_ids], vocab_size, device)
    repetition = offset = None
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts([rows[i].prompt_token_ids for i in row_ids], vocab_size, device)
        seen = (prompt_counts > 0).logical_or_(output_counts > 0)  # [num_penalized, vocab]
        repetition = torch.where(seen, _float([p.repetition_penalty for p in params], device).unsqueeze(1), 1.0)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        presence = _float([p.presence_penalty for p in params], device).unsqueeze(1)  # [num_penalized, 1]
        frequency = _float([p.frequency_penalty for p in params], device).unsqueeze(1)  # [num_penalized, 1]
        offset = torch.where(output_counts > 0, presence, 0.0).add_(output_counts.mul_(frequency))
    return Penalties(_long(row_ids, device), repetition, offset)


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> Tensor:
    flat_ids = _long(list(chain.from_iterable(token_ids)), device)  # [num_tokens]
    row_ids = torch.repeat_interleave(
        torch.arange(len(token_ids), device=device), _long([len(ids) for ids in token_ids], device),
        output_size=flat_ids.numel(),
    )  # [num_tokens]
    counts = torch.zeros(len(token_ids) * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, row_ids * vocab_size + flat_ids, torch.ones_like(flat_ids, dtype=torch.float32))
    return counts.view(len(token_ids), vocab_size)


def _banned(
    rows: Sequence[SamplingInput], eos_token_ids: Sequence[int], vocab_size: int, device: torch.device | str
) -> RowValues | None:
    pairs = [
        (i, token_id)
        for i, row in enumerate(rows)
        if len(row.output_token_ids) < row.params.min_tokens
        for token_id in sorted({*eos_token_ids, *row.params.stop_token_ids})
        if token_id < vocab_size
    ]
    if not pairs:
        return None
    return RowValues(_long([i for i, _ in pairs], device), _long([t for _, t in pairs], device))


def _mix_(x: Tensor) -> Tensor:
    """Wellons' lowbias32 in place on int64 holding uint32 values. Both multipliers are below
    2**31, so no product leaves int64 and every backend computes the same bits."""
    tmp = torch.empty_like(x)
    for shift, multiplier in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))
        x.mul_(multiplier).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))


def row_keys(seed_lo: Tensor, seed_hi: Tensor, positions: Tensor) -> Tensor:
    """[num_rows] keys of a counter-based generator; inputs hold uint32 values."""
    key = _mix_(seed_lo ^ _SEED_SALT)
    key = _mix_(key.bitwise_xor_(seed_hi))
    return _mix_(key.bitwise_xor_(positions))


def gumbel_noise(keys: Tensor, vocab_ids: Tensor) -> Tensor:
    """Standard Gumbel noise, a pure function of (key, vocab id): [num_rows, vocab] for
    vocab_ids [vocab], or [num_rows, n] for per-row vocab_ids [num_rows, n]."""
    vocab_salts = _mix_(vocab_ids ^ _VOCAB_SALT)
    bits = _mix_(keys.unsqueeze(1) ^ vocab_salts)  # [num_rows, vocab or n]
    # 23 bits put u = (m + 0.5) / 2**23 strictly inside (0, 1), exactly, in float32.
    uniform = bits.bitwise_right_shift_(9).to(torch.float32).add_(0.5).mul_(2.0**-23)
    return uniform.log_().neg_().log_().neg_()


def process_logits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[num_rows, vocab] logits after grammar masks, min_tokens bans and penalties; what greedy rows argmax.
    Returns `logits` itself when nothing applies, else a new tensor."""
    if batch.banned is None and batch.penalties is None and batch.allowed is None:
        return logits
    logits = logits.clone()
    if batch.allowed is not None:
        # every row, not just the constrained ones: a gather and scatter of those rows costs more
        logits.masked_fill_(~_unpack_bits(batch.allowed, batch.vocab_size), -math.inf)
    if batch.banned is not None:
        logits[batch.banned.row_ids, batch.banned.values] = -math.inf
    if batch.penalties is not None:
        pen = batch.penalties
        logits[pen.row_ids] = _apply_penalties(logits[pen.row_ids], pen)
    return logits


def _unpack_bits(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[n, vocab] bool from an int32 bitmask [n, words], little-endian bits within each word."""
    if bitmask.device.type == "cpu":
        # numpy's unpackbits is ~100x faster than the shifts below on the CPU (0.1 ms for 32 rows); on a
        # little-endian CPU (x86, Arm) byte k of word w holds tokens 32w + 8k ... 32w + 8k + 7, low bit first
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [n, words * 32]
        return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = bitmask.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)  # [n, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _apply_penalties(logits: Tensor, pen: Penalties) -> Tensor:
    if pen.repetition is not None:
        # Dividing (not multiplying by the inverse) matches HF bit for bit.
        logits = torch.where(logits > 0, logits / pen.repetition, logits * pen.repetition)
    if pen.offset is not None:
        logits = logits.sub_(pen.offset)
    return logits


def filter_logits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[num_random, vocab] temperature-scaled logits of the sampling rows, with the tokens that
    top-k, top-p and min-p exclude set to -inf."""
    random = batch.random
    assert random is not None
    scaled = logits.index_select(0, random.row_ids).div_(random.temperature)  # [num_random, vocab]
    if random.top_k is not None:
        scaled[random.top_k.row_ids] = _apply_top_k(scaled[random.top_k.row_ids], random.top_k.values, random.max_top_k)
    if random.top_p is not None:
        scaled[random.top_p.row_ids] = _apply_top_p(scaled[random.top_p.row_ids], random.top_p.values)
    if random.log_min_p is not None:
        scaled[random.log_min_p.row_ids] = _apply_min_p(scaled[random.log_min_p.row_ids], random.log_min_p.values)
    return scaled


def _apply_top_k(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    top_values = logits.topk(max_top_k, dim=-1).values  # [n, max_top_k] descending
    kth_values = top_values.gather(1, top_k.unsqueeze(1) - 1)  # [n, 1]
    # Ties with the k-th value stay, as in HF and vLLM.
    return logits.masked_fill_(logits < kth_values, -math.inf)


def _apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    log_norm = logits.logsumexp(dim=-1, keepdim=True)  # [n, 1]
    num_candidates = min(_TOP_P_CANDIDATES, logits.shape[-1])
    min_logits, is_cut_short = _nucleus_min_logits(logits, log_norm, top_p, num_candidates)  # [n], [n]
    if num_candidates < logits.shape[-1] and bool(is_cut_short.any()):
        rows = is_cut_short.nonzero().squeeze(1)
        min_logits[rows] = _nucleus_min_logits(logits[rows], log_norm[rows], top_p[rows], logits.shape[-1])[0]
    return logits.masked_fill_(logits < min_logits.unsqueeze(1), -math.inf)


def _nucleus_min_logits(
    logits: Tensor, log_norm: Tensor, top_p: Tensor, num_candidates: int
) -> tuple[Tensor, Tensor]:
    """Smallest kept logit per row: a token stays while the probability mass ranked above it
    is below top_p (HF/vLLM). Also says which rows kept every candidate and may need more."""
    top_logits = logits.topk(num_candidates, dim=-1).values  # [n, num_candidates] descending
    top_probs = (top_logits - log_norm).exp_()  # [n, num_candidates]
    mass_above = top_probs.cumsum(dim=-1).sub_(top_probs)  # [n, num_candidates]
    num_kept = (mass_above < top_p.unsqueeze(1)).sum(dim=-1)  # [n], >= 1 as mass_above[:, 0] == 0
    return top_logits.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1), num_kept == num_candidates


def _apply_min_p(logits: Tensor, log_min_p: Tensor) -> Tensor:
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed.
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)  # [n, 1]
    return logits.masked_fill_(logits < threshold, -math.inf)


class Sampler:
    """Picks one token per row. Greedy rows take exactly `argmax(process_logits(...))`. A sampling
    row's token depends only on its own logits, params, seed and len(output_token_ids), never on
    the other rows of the batch or their order."""

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.shape == (batch.num_rows, batch.vocab_size), logits.shape
        logits = logits.float()  # a no-op for float32; noise and logprobs need float32 precision
        if batch.is_plain_greedy:
            return SamplerOutput(self.greedy(logits), None, None)
        raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs is not None else None  # [num_rows, vocab]
        token_ids = _pick_tokens(process_logits(logits, batch), batch)  # [num_rows]
        if raw_logprobs is None:
            return SamplerOutput(token_ids.tolist(), None, None)
        assert batch.num_logprobs is not None
        return SamplerOutput(token_ids.tolist(), *_logprobs(raw_logprobs, token_ids, batch.num_logprobs))


    @staticmethod
    def greedy(logits: Tensor) -> list[int]:
        """The tokens of a batch of plain greedy rows (no penalty, mask or logprobs)."""
        return _argmax(logits.float()).tolist()


def _argmax(logits: Tensor) -> Tensor:
    """[num_rows] the first index of each row's largest logit. On the CPU the C kernel (2-2.3x faster
    than torch's indexed max at 16-256 rows of a 49k vocabulary, one core); elsewhere max(), which
    returns the first maximal index as argmax does and is several times faster than it on a CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1 \
            and gumbel_kernel.load() is not None:
        try:
            return gumbel_kernel.argmax(logits)
        except ValueError:  # a row of -inf or NaN only: torch's answer, whatever a broken row gets
            pass
    return logits.max(dim=-1).indices


def _pick_tokens(logits: Tensor, batch: SamplingBatch) -> Tensor:
    random = batch.random
    if random is None:
        return _argmax(logits)
    token_ids = torch.empty(batch.num_rows, dtype=torch.long, device=logits.device)  # [num_rows]
    if batch.greedy_row_ids is not None:
        token_ids[batch.greedy_row_ids] = _argmax(logits[batch.greedy_row_ids])
    token_ids[random.row_ids] = _gumbel_argmax(filter_logits(logits, batch), random.keys)
    return token_ids


def _gumbel_argmax(scores: Tensor, keys: Tensor) -> Tensor:
    """[num_random] argmax of scores + Gumbel noise. When the filters leave few finite scores,
    the noise is drawn for those alone; the result is the same, as noise depends on vocab ids."""
    vocab_size = scores.shape[-1]
    num_finite = int((scores > -math.inf).sum(dim=-1).max())
    if num_finite * _SPARSE_NOISE_RATIO > vocab_size:
        if scores.device.type == "cpu" and gumbel_kernel.load() is not None:
            return gumbel_kernel.gumbel_argmax(scores, keys, _VOCAB_SALT)
        vocab_ids = torch.arange(vocab_size, device=scores.device)  # [vocab]
        return _argmax(scores.add_(gumbel_noise(keys, vocab_ids)))
    # Ascending ids make exact ties resolve to the lowest id, as the dense argmax does.
    vocab_ids = scores.topk(num_finite, dim=-1).indices.sort(dim=-1).values  # [num_random, num_finite]
    window = scores.gather(1, vocab_ids).add_(gumbel_noise(keys, vocab_ids))  # [num_random, num_finite]
    return vocab_ids.gather(1, window.argmax(dim=-1, keepdim=True)).squeeze(1)


def _logprobs(
    raw_logprobs: Tensor, token_ids: Tensor, num_logprobs: list[int | None]
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_num = max((n for n in num_logprobs if n is not None), default=0)
    if max_num == 0:
        return chosen, [[] for _ in num_logprobs]
    top = raw_logprobs.topk(max_num, dim=-1)  # [num_rows, max_num]
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    top_logprobs = [
        list(zip(ids[: n or 0], values[: n or 0], strict=True))
        for ids, values, n in zip(top_ids, top_values, num_logprobs, strict=True)
    ]
    return chosen, top_logprobs

"""Seeded synthetic workloads: which prompts to send and how many tokens to ask for."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

WORKLOADS = ("random", "shared-prefix", "chat-mix")


class Detokenizer(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(slots=True, frozen=True)
class BenchRequest:
    prompt: list[int] | str
    num_prompt_tokens: int
    max_tokens: int


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    """Every workload knob; each workload reads only the fields it names in its docstring."""

    name: str
    num_prompts: int
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    num_groups: int = 8
    prefix_len: int = 512
    suffix_len: int = 64
    length_sigma: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose from {', '.join(WORKLOADS)}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if min(self.input_len, self.output_len, self.num_groups, self.suffix_len) < 1:
            raise ValueError("input_len, output_len, num_groups and suffix_len must be >= 1")
        if self.prefix_len < 0 or self.length_sigma < 0:
            raise ValueError("prefix_len and length_sigma must be >= 0")


def build_workload(spec: WorkloadSpec, vocab_ids: np.ndarray, seed: int) -> list[BenchRequest]:
    """The same spec, vocabulary and seed always give the same requests in the same order."""
    # seed roots independent streams ([seed, 0] here, [seed, 1] arrivals, [seed, 2] warm-ups)
    # so the prompts do not change when only the arrivals or the warm-ups do.
    rng = np.random.default_rng([seed, 0])
    return _GENERATORS[spec.name](spec, vocab_ids, rng)


# a seed's random streams 0-2 are a workload's prompts, arrivals and warm-ups; repeated runs of the
# same lengths draw fresh tokens from [seed, FRESH_TOKENS_STREAM, ...]
FRESH_TOKENS_STREAM = 3


def warmup_requests(requests: list[BenchRequest], vocab_ids: np.ndarray, seed: int, num: int) -> list[BenchRequest]:
    """Requests shaped like the first `num` of a workload but with fresh tokens, so they warm
    the server up (compilation, allocation) without filling its prefix cache for the run."""
    return with_fresh_tokens(requests[:num], vocab_ids, [seed, 2])


def with_fresh_tokens(requests: list[BenchRequest], vocab_ids: np.ndarray, key: Sequence[int]) -> list[BenchRequest]:
    """The same prompt and output lengths with new tokens drawn from the random stream `key`: a
    server's prefix cache holds none of them, where it may hold the originals."""
    rng = np.random.default_rng(list(key))
    return [_request(_tokens(rng, vocab_ids, req.num_prompt_tokens), req.max_tokens) for req in requests]


def vocab_from_size(vocab_size: int) -> np.ndarray:
    if vocab_size < 1:
        raise ValueError("vocab_size must be >= 1")
    return np.arange(vocab_size, dtype=np.int64)


def vocab_from_tokenizer(num_tokens: int, special_ids: list[int]) -> np.ndarray:
    """All ids except special ones, so decoded text prompts carry no control tokens."""
    ids = np.setdiff1d(np.arange(num_tokens, dtype=np.int64), np.asarray(special_ids, dtype=np.int64))
    assert len(ids) > 0, "the tokenizer has only special tokens"
    return ids


def as_text(requests: list[BenchRequest], tokenizer: Detokenizer) -> list[BenchRequest]:
    """Decode id prompts for servers that only take text; the server's usage reports the real
    prompt length, because decode-then-encode does not always round-trip."""
    return [_decoded(req, tokenizer) for req in requests]


def _decoded(req: BenchRequest, tokenizer: Detokenizer) -> BenchRequest:
    assert not isinstance(req.prompt, str), "the prompt is already text"
    return dataclasses.replace(req, prompt=tokenizer.decode(req.prompt))


def _random(spec: WorkloadSpec, vocab_ids: np.ndarray, rng: np.random.Generator) -> list[BenchRequest]:
    """input_len and output_len, each drawn uniformly from [len * (1 - r), len * (1 + r)]."""
    input_lens = _uniform_lens(rng, spec.input_len, spec.range_ratio, spec.num_prompts)
    output_lens = _uniform_lens(rng, spec.output_len, spec.range_ratio, spec.num_prompts)
    return [_request(_tokens(rng, vocab_ids, n_in), n_out) for n_in, n_out in zip(input_lens, output_lens, strict=True)]


def _shared_prefix(spec: WorkloadSpec, vocab_ids: np.ndarray, rng: np.random.Generator) -> list[BenchRequest]:
    """num_groups prefixes of prefix_len tokens; request i uses prefix i % num_groups plus
    its own suffix_len tokens and asks for output_len tokens; the order is then shuffled."""
    prefixes = [_tokens(rng, vocab_ids, spec.prefix_len) for _ in range(spec.num_groups)]
    requests = [
        _request(prefixes[i % spec.num_groups] + _tokens(rng, vocab_ids, spec.suffix_len), spec.output_len)
        for i in range(spec.num_prompts)
    ]
    order = rng.permutation(spec.num_prompts)
    return [requests[i] for i in order]


def _chat_mix(spec: WorkloadSpec, vocab_ids: np.ndarray, rng: np.random.Generator) -> list[BenchRequest]:
    """Lognormal lengths with medians input_len and output_len and log-space spread
    length_sigma, clipped to [1, max_*_len] (default 4x the median). Input lengths, output
    lengths and tokens come from three streams of the seed, so the first k requests are the same
    whatever num_prompts is: a sweep that takes the first k of one sample per rate sends the same
    requests at a rate whatever other rates it sweeps."""
    max_in = spec.max_input_len or 4 * spec.input_len
    max_out = spec.max_output_len or 4 * spec.output_len
    input_rng, output_rng, token_rng = rng.spawn(3)
    input_lens = _lognormal_lens(input_rng, spec.input_len, spec.length_sigma, max_in, spec.num_prompts)
    output_lens = _lognormal_lens(output_rng, spec.output_len, spec.length_sigma, max_out, spec.num_prompts)
    return [
        _request(_tokens(token_rng, vocab_ids, n_in), n_out) for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


_GENERATORS: dict[str, Callable[[WorkloadSpec, np.ndarray, np.random.Generator], list[BenchRequest]]] = {
    "random": _random,
    "shared-prefix": _shared_prefix,
    "chat-mix": _chat_mix,
}


def _request(prompt_ids: list[int], max_tokens: int) -> BenchRequest:
    return BenchRequest(prompt=prompt_ids, num_prompt_tokens=len(prompt_ids), max_tokens=max_tokens)


def _tokens(rng: np.random.Generator, vocab_ids: np.ndarray, num_tokens: int) -> list[int]:
    token_ids: list[int] = rng.choice(vocab_ids, size=num_tokens).tolist()
    return token_ids


def _uniform_lens(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> list[int]:
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    lens: list[int] = rng.integers(low, high + 1, size=n).tolist()
    return lens


def _lognormal_lens(rng: np.random.Generator, median: int, sigma: float, max_len: int, n: int) -> list[int]:
    drawn = np.rint(rng.lognormal(mean=np.log(median), sigma=sigma, size=n))
    lens: list[int] = np.clip(drawn, 1, max_len).astype(np.int64).tolist()
    return lens

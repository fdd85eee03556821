"""Structured output: a constraint that travels in SamplingParams, the grammar it compiles to
(cached by constraint), and a matcher per request that says which tokens may come next.

    StructuredSpec (params) --Grammars.compile, cached--> compiled grammar
    Grammars.matcher(spec, output so far) --> GrammarMatcher on the Request
    each step:  token_masks(matchers) -> the sampler sets those rows' other tokens to -inf
                Request.append_output -> matcher.accept(token)

A matcher is a pure function of (spec, output tokens), so the prefill worker, the decode worker
it hands over to, and a worker that re-runs a request after a crash all rebuild the same state.
The grammar admits the end-of-sequence tokens only where the output is complete, so a
constrained request ends with `stop` only when its text matches, else with `length`.
Backend: xgrammar (docs/structured-output.md has the measurement that chose it over llguidance).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from threading import Lock

import torch
import xgrammar as xgr

from shared.engine.constraint import GrammarError, StructuredSpec
from shared.text.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> None:
        # the mask allowed only acceptable tokens, so a refusal means the output broke the grammar
        if not self._matcher.accept_token(token_id):
            raise GrammarError(f"token {token_id} does not continue the output under its grammar")

    @property
    def is_terminated(self) -> bool:
        """The output is complete and ended with an end-of-sequence token."""
        return bool(self._matcher.is_terminated())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles constraints for one tokenizer, keeping the most recent compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[StructuredSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = Lock()  # the gateway compiles on several threads
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        with self._lock:
            if (hit := self._cache.get(spec)) is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        compiler = self._compiler
        try:
            if spec.kind == "json_schema":
                # no free whitespace: small models otherwise fill max_tokens with newlines
                return compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_grammar(_choice_ebnf(json.loads(spec.value)))
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"the {spec.kind} constraint does not compile: {_first_line(exc)}") from exc

    def matcher(self, spec: StructuredSpec, output_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher that has accepted `output_token_ids` (the output of an earlier run or of prefill)."""
        matcher = GrammarMatcher(self.compile(spec))
        for token_id in output_token_ids:
            matcher.accept(token_id)
        return matcher


def _choice_ebnf(options: list[str]) -> str:
    if not options or not all(isinstance(o, str) and o for o in options):
        raise ValueError("choice needs at least one option, each a non-empty string")
    return "root ::= " + " | ".join(json.dumps(option) for option in options)


def _first_line(exc: Exception) -> str:
    # xgrammar prefixes its messages with a timestamp and source location
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def token_masks(matchers: Sequence[GrammarMatcher | None], vocab_size: int) -> torch.Tensor | None:
    """Every row's allowed tokens as an int32 bitmask [num_rows, ceil(vocab / 32)] (bit j of word w
    allows token 32w + j; a row without a matcher allows all), or None when no row has a matcher."""
    if all(matcher is None for matcher in matchers):
        return None
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)  # all ones
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill_mask(bitmask, row)
    return bitmask

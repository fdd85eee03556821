"""Incremental detokenisation of one sequence's output, with stop strings.

A byte-level BPE vocabulary (`Tokenizer.byte_pieces`) decodes a token at a time: its bytes go through
an incremental UTF-8 decoder, which holds back a character split across tokens until its last byte.
Other vocabularies decode a small window per token instead of the whole output (vLLM's
detokenize_incrementally):

    window = [ prefix tokens | pending tokens ]
              ^ already emitted ^ read_offset

    delta = decode(window)[len(decode(prefix tokens)):]

The prefix gives the decoder its left context (SentencePiece drops a leading space at the start
of a decode), and pending tokens stay pending while the window decodes to a trailing U+FFFD,
i.e. while a multi-byte character is still split across tokens. The byte path costs about 0.6 us
a token, the window's two decodes about 5.
"""

from __future__ import annotations

import codecs

from shared.text.tokenizer import Tokenizer

# Prompt tokens kept as left context for the first output token.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _BytePieces:
    """Text of a byte-level vocabulary's tokens, one token's bytes at a time."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces
        self._num_pieces = len(pieces)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_ids: list[int]) -> str:
        pieces, num_pieces = self._pieces, self._num_pieces
        # decoding skips ids past the vocabulary (a model's padded rows), as the tokenizer does
        data = b"".join([pieces[i] if i < num_pieces else b"" for i in token_ids])
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _DecodedWindow:
    """Text of any vocabulary's tokens, from decoding a small window per token."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(self._window).endswith(_REPLACEMENT_CHAR):
            # A prompt cut mid-character cannot serve as clean left context.
            self._window = []
        self._read_offset = len(self._window)

    def add(self, token_ids: list[int]) -> str:
        parts = []
        for token_id in token_ids:  # a trailing split character holds back only itself
            self._window.append(token_id)
            parts.append(self._read_pending(final=False))
        return "".join(parts)

    def flush(self) -> str:
        return self._read_pending(final=True)

    def _read_pending(self, final: bool) -> str:
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[: self._read_offset])
        text = self._decode(self._window)
        if not final and (text.endswith(_REPLACEMENT_CHAR) or len(text) <= len(prefix_text)):
            return ""
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


class IncrementalDetokenizer:
    """Turns output token ids into text deltas; deltas never split a character or leak a stop string.

    Contract: the concatenation of every `add()` and the final `flush()` equals
    `tokenizer.decode(output_ids)` cut before the first stop string, when the prompt ends on a
    character boundary (byte-level BPE; SentencePiece keeps the space the prompt context implies).
    `num_output_tokens` counts the tokens consumed, up to and including the one that completed
    a stop string; later tokens are ignored.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
    ) -> None:
        pieces = tokenizer.byte_pieces(skip_special_tokens)
        self._text: _BytePieces | _DecodedWindow = (
            _BytePieces(pieces) if pieces is not None
            else _DecodedWindow(tokenizer, prompt_token_ids, skip_special_tokens)
        )
        self._stop = [s for s in stop or [] if s]
        self._held_text = ""
        self.num_output_tokens = 0
        self.stop_str: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    @property
    def finish_reason(self) -> str | None:
        """`"stop"` once a stop string matched; other endings (eos, length) are the engine's to report."""
        return "stop" if self.stopped else None

    def add(self, token_ids: list[int]) -> str:
        """Consume new output tokens; return the text they complete (possibly "")."""
        if not self._stop:
            self.num_output_tokens += len(token_ids)
            return self._text.add(token_ids)
        parts = []
        for token_id in token_ids:  # one at a time: the count stops at the token that completes a stop string
            if self.stopped:
                break
            self.num_output_tokens += 1
            if delta := self._text.add([token_id]):
                parts.append(self._accept(delta, final=False))
        return "".join(parts)

    def flush(self) -> str:
        """At the end of generation: everything still held back (a stop string still applies)."""
        if self.stopped:
            return ""
        return self._accept(self._text.flush(), final=True)

    def _accept(self, new_text: str, final: bool) -> str:
        text = self._held_text + new_text
        if not self._stop:
            return text
        match = self._find_stop(text)
        if match is not None:
            start, self.stop_str = match
            self._held_text = ""
            return text[:start]
        num_held = 0 if final else self._partial_stop_len(text)
        self._held_text = text[len(text) - num_held :]
        return text[: len(text) - num_held]

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in `text` (ties go to the first listed)."""
        found = [(start, s) for s in self._stop if (start := text.find(s)) >= 0]
        return min(found, key=lambda hit: hit[0]) if found else None

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string begins with."""
        longest = 0
        for s in self._stop:
            for size in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:size]):
                    longest = size
                    break
        return longest

"""Text <-> token ids for one model, loaded from a GGUF file or a Hugging Face checkpoint folder.

The reference is `transformers.AutoTokenizer` on the same files: loading goes through it (so the
GGUF vocabulary conversion, BOS policy and chat template rendering are exactly the reference's),
while encode/decode run on a private copy of its Rust `tokenizers` backend, which is what the
reference calls underneath minus the Python overhead.

Converting a GGUF's vocabulary takes transformers about 8 s for SmolLM2, on every gateway
start; the converted tokenizer is saved to the disk cache (`kernels.disk_cache`,
`models/<name>-<key>/tokenizer-v1-transformers-<version>/`) and later starts load that.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2
import transformers
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kernels.disk_cache import derived_folder, load_or_build

# llama.cpp marks every token that ends a turn with one of these keys, besides eos.
_GGUF_END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# the disk cache's entry for a converted GGUF tokenizer: another transformers may convert differently
_GGUF_CACHE_ENTRY = f"tokenizer-v1-transformers-{transformers.__version__}"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: no chat template, or the template rejected them."""


class Tokenizer:
    """One model's tokenizer; encode/decode/chat templates equal the transformers reference."""

    def __init__(self, hf: PreTrainedTokenizerBase, name: str, eos_token_ids: list[int]) -> None:
        self._hf = hf
        self._fast = _standalone_backend(hf)
        # The reference only cleans up spaces for a few non-BPE vocabularies; delegate those.
        self._slow_decode = bool(hf.clean_up_tokenization_spaces)
        self._byte_level = isinstance(self._fast.decoder, decoders.ByteLevel)
        self._byte_of_char = {c: b for b, c in _bytes_to_unicode().items()}
        self._byte_pieces: dict[bool, list[bytes] | None] = {}
        self.name = name
        self.eos_token_ids = eos_token_ids
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = hf.chat_template

    @classmethod
    def from_path(cls, path: str, disk_cache: bool = True) -> Tokenizer:
        """Load from a `.gguf` file, or a folder holding a checkpoint (or exactly one `.gguf`).

        `disk_cache`: load a GGUF's converted tokenizer from the disk cache, saving it there on first use.
        """
        target = Path(path)
        if target.is_file() and target.suffix == ".gguf":
            return cls._from_gguf(target, disk_cache)
        if target.is_dir():
            if (target / "tokenizer.json").is_file() or (target / "tokenizer_config.json").is_file():
                return cls._from_folder(target)
            ggufs = sorted(target.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls._from_gguf(ggufs[0], disk_cache)
        raise FileNotFoundError(f"no .gguf file or tokenizer checkpoint folder at {path}")

    @classmethod
    def _from_gguf(cls, path: Path, disk_cache: bool) -> Tokenizer:
        def convert() -> PreTrainedTokenizerBase:
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)

        def read(folder: Path) -> PreTrainedTokenizerBase:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

        def write(hf: PreTrainedTokenizerBase, folder: Path) -> None:
            hf.save_pretrained(str(folder))

        folder = derived_folder("models", path, _GGUF_CACHE_ENTRY)
        what = f"converting the tokenizer of {path.name}"
        hf = load_or_build(folder, read, convert, write, what=what) if disk_cache else convert()
        metadata = _gguf_metadata(path)
        end_ids = [int(metadata[key]) for key in _GGUF_END_KEYS if key in metadata]
        return cls(hf, name=path.stem, eos_token_ids=_unique([hf.eos_token_id, *end_ids]))

    @classmethod
    def _from_folder(cls, path: Path) -> Tokenizer:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        # transformers' generate() stops on generation_config's ids, falling back to config's.
        config_ids = _eos_ids_in(path / "generation_config.json") or _eos_ids_in(path / "config.json")
        return cls(hf, name=path.name, eos_token_ids=_unique([hf.eos_token_id, *config_ids]))

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer this one was loaded through (the reference)."""
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._slow_decode:
            return str(self._hf.decode(token_ids, skip_special_tokens=skip_special_tokens))
        return self._fast.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        tokens = []
        for token_id in token_ids:
            token = self._fast.id_to_token(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
            tokens.append(token)
        return tokens

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token contributes to the decoded text (for logprobs' `bytes`)."""
        (token,) = self.convert_ids_to_tokens([token_id])
        if self._byte_level:
            if all(c in self._byte_of_char for c in token):
                return bytes(self._byte_of_char[c] for c in token)
            return token.encode()
        if match := _BYTE_FALLBACK_TOKEN.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        return token.replace("\u2581", " ").encode()

    def byte_pieces(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each token id's bytes in decoded text (b"" for a special token that decoding skips), where
        `decode(ids)` is the UTF-8 of the ids' pieces joined (invalid bytes replaced by U+FFFD): a
        byte-level BPE vocabulary without clean-up. None for other vocabularies, and where a single
        token's decode disagrees with its piece (checked for every token, about 0.3 s once)."""
        if skip_special_tokens not in self._byte_pieces:
            self._byte_pieces[skip_special_tokens] = self._build_byte_pieces(skip_special_tokens)
        return self._byte_pieces[skip_special_tokens]

    def _build_byte_pieces(self, skip_special_tokens: bool) -> list[bytes] | None:
        if not self._byte_level or self._slow_decode:
            return None
        special = {i for i, added in self._fast.get_added_tokens_decoder().items() if added.special}
        skipped = special if skip_special_tokens else set()
        pieces = [b"" if i in skipped else self.token_bytes(i) for i in range(self.vocab_size)]
        every_id = [[i] for i in range(self.vocab_size)]
        decoded = self._fast.decode_batch(every_id, skip_special_tokens=skip_special_tokens)
        if any(piece.decode("utf-8", "replace") != text for piece, text in zip(pieces, decoded)):
            return None
        return pieces

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template renders function definitions passed as `tools`."""
        return bool(self.chat_template) and "tools" in str(self.chat_template)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template applied to `messages` (and `tools`, for a template that knows them), as text."""
        if not self.chat_template:
            raise ChatTemplateError(f"model {self.name} has no chat template")
        try:
            text = self._hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
        assert isinstance(text, str)
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own special tokens."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)


def _standalone_backend(hf: PreTrainedTokenizerBase) -> FastTokenizer:
    """A copy of the reference's backend that never pads or truncates behind our back."""
    fast = FastTokenizer.from_str(hf.backend_tokenizer.to_str())
    fast.no_padding()
    fast.no_truncation()
    return fast


def _gguf_metadata(path: Path) -> dict[str, Any]:
    # The reader transformers itself uses: it skips the tensor table's payload, so it is quick.
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))
    return metadata


def _eos_ids_in(config_path: Path) -> list[int]:
    if not config_path.is_file():
        return []
    eos = json.loads(config_path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def _unique(ids: list[int | None]) -> list[int]:
    return list(dict.fromkeys(i for i in ids if i is not None))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shared.text import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello world",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nend",
    "numbers 1234567890 3.14159 -42 1e10",
    "punctuation!?.,;:'\"()[]{}<>@#$%^&*_-+=~`|\\/",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇯🇵 ❤️",
    "CJK 你好，世界。こんにちは 안녕하세요",
    "accents café naïve résumé Ångström",
    "mixed scripts: Привет мир, مرحبا بالعالم, שלום, नमस्ते",
    "zero\u200bwidth and nbsp\u00a0here and combining e\u0301",
    "code: def f(x):\n    return x ** 2  # square\n",
    "special tokens in text <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "repeated " + "a" * 300,
    "\u0000 control \u0007 chars \u001b[0m",
    "url https://example.com/path?q=1&r=2#frag",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 😀"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "你好？"},
    ],
    [{"role": "user", "content": "  spaces\n\nand newlines  "}],
]


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_reference(tokenizer: Tokenizer, reference: PreTrainedTokenizerBase, text: str) -> None:
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_equals_reference(tokenizer: Tokenizer, reference: PreTrainedTokenizerBase, text: str) -> None:
    ids = reference.encode(text)
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)


def test_smollm2_gets_no_bos_like_reference(tokenizer: Tokenizer, reference: PreTrainedTokenizerBase) -> None:
    # The GGUF says add_bos_token=false, and the reference honours it.
    assert reference.encode("Hello world") == [19556, 905]
    assert tokenizer.encode("Hello world") == [19556, 905]
    assert tokenizer.bos_token_id == 1


def test_special_tokens_are_skipped_on_decode_only_when_asked(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_metadata_of_smollm2_gguf(tokenizer: Tokenizer) -> None:
    assert tokenizer.name == "SmolLM2-135M-Instruct.Q4_1"
    assert tokenizer.eos_token_ids == [2]
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_ids) == ["<|im_end|>"]
    assert tokenizer.vocab_size == 49152


def test_convert_ids_to_tokens_spells_byte_level_pieces(tokenizer: Tokenizer) -> None:
    assert tokenizer.convert_ids_to_tokens([19556, 905]) == ["Hello", "Ġworld"]
    with pytest.raises(ValueError, match="token id 49152 is outside the vocabulary \\(49152\\)"):
        tokenizer.convert_ids_to_tokens([1, 49152])


def test_token_bytes_concatenate_to_the_utf8_text(tokenizer: Tokenizer) -> None:
    text = "Hi 😀 你好 café"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    assert any(not _is_utf8(piece) for piece in pieces), "expected the emoji to be split mid-character"
    assert tokenizer.token_bytes(2) == b"<|im_end|>"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_reference(
    tokenizer: Tokenizer,
    reference: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    expected_text = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    expected_ids = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert tokenizer.render_chat(messages, add_generation_prompt) == expected_text
    assert tokenizer.apply_chat_template(messages, add_generation_prompt) == expected_ids


def test_chat_template_inserts_default_system_prompt(tokenizer: Tokenizer) -> None:
    text = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[:3] == [1, 9690, 198]
    assert ids[-4:] == [1, 520, 9531, 198]


def test_chat_template_error_is_a_chat_template_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="chat template rejected the messages"):
        tokenizer.render_chat([{"role": "user", "content": None}])


def test_folder_checkpoint_loads_like_reference(
    tokenizer: Tokenizer, reference: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    folder = _checkpoint_folder(reference, tmp_path, generation_eos=[2, 0])
    from_folder = Tokenizer.from_path(str(folder))
    folder_reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert from_folder.name == "ckpt"
    assert from_folder.eos_token_ids == [2, 0]
    for text in TEXTS:
        assert from_folder.encode(text) == folder_reference.encode(text) == tokenizer.encode(text)
    messages = CONVERSATIONS[1]
    assert from_folder.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_folder_eos_falls_back_to_config_json(reference: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    folder = _checkpoint_folder(reference, tmp_path, generation_eos=None)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_path(str(folder)).eos_token_ids == [2, 0]


def test_folder_without_chat_template_refuses_chat(reference: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    folder = _checkpoint_folder(reference, tmp_path, generation_eos=None)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    no_template = Tokenizer.from_path(str(folder))
    with pytest.raises(ChatTemplateError, match="model ckpt has no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])


def test_folder_holding_one_gguf_loads_it(gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / gguf_path.name).symlink_to(gguf_path)
    loaded: list[Path] = []
    monkeypatch.setattr(Tokenizer, "_from_gguf", classmethod(lambda cls, path, disk_cache: loaded.append(path)))
    Tokenizer.from_path(str(tmp_path))
    assert loaded == [tmp_path / gguf_path.name]


def test_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \.gguf file or tokenizer checkpoint folder at"):
        Tokenizer.from_path(str(tmp_path / "nope"))


def _checkpoint_folder(reference: PreTrainedTokenizerBase, tmp_path: Path, generation_eos: list[int] | None) -> Path:
    folder = tmp_path / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    reference.save_pretrained(str(folder))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return folder


def _is_utf8(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return False
    return True

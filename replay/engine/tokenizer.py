"""Text <-> token ids for the builtin engine. Only text prompts and rendered outputs need a tokenizer: the
engine itself, captures and replay work on token ids, so a checkpoint without tokenizer.json still runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from replay.errors import UsageError


class Tokenizer(Protocol):
    """What the engine and the CLI ask of a tokenizer."""

    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Text -> token ids, with whatever special tokens the model expects at the start."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text, special tokens left out."""
        ...


class ByteTokenizer:
    """The `tiny` model's tokenizer: one token per UTF-8 byte (id = 3 + byte) after the specials 0 pad, 1 bos, 2 eos."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3  # first byte id; ids OFFSET .. OFFSET + 255 are bytes, so 259 ids in all
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        """bos, then one id per UTF-8 byte."""
        return [self.BOS] + [self.OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; specials and ids past the byte range are skipped, invalid UTF-8 becomes U+FFFD."""
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.OFFSET + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json, through the `tokenizers` library."""

    def __init__(self, tok: Any, bos_token_id: int | None, eos_token_id: int | None):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        """Text -> ids, special tokens added as the tokenizer's post-processor says (e.g. a leading bos)."""
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        """Ids -> text without special tokens."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _special_id(tok: Any, d: Path, which: str) -> int | None:
    """The id of `bos`/`eos`: tokenizer_config.json's token string first, else config.json's `<which>_token_id`."""
    for name, key in (("tokenizer_config.json", f"{which}_token"), ("config.json", f"{which}_token_id")):
        try:
            value = json.loads((d / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
            value = value.get("content")
        if isinstance(value, str):
            tid = tok.token_to_id(value)
            if tid is not None:
                return tid
        elif isinstance(value, list) and value and isinstance(value[0], int):
            return value[0]  # several eos ids: the engine reads the full list from ModelConfig
        elif isinstance(value, int):
            return value
    return None


def load_tokenizer(name_or_path: str) -> Tokenizer | None:
    """`tiny` -> ByteTokenizer; a checkpoint directory with tokenizer.json -> its tokenizer; without one -> None
    (only token-id prompts work then)."""
    if name_or_path == "tiny":
        return ByteTokenizer()
    d = Path(name_or_path)
    if not d.is_dir():
        raise UsageError(f"model {name_or_path!r} is not a directory: give `tiny` or a local checkpoint directory")
    if not (d / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer as _Tokenizers
    except ImportError:
        raise UsageError("text prompts need the `tokenizers` package (pip install tokenizers)") from None
    try:
        tok = _Tokenizers.from_file(str(d / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on malformed files
        raise UsageError(f"{d / 'tokenizer.json'}: cannot load ({e})") from None
    return HFTokenizer(tok, _special_id(tok, d, "bos"), _special_id(tok, d, "eos"))

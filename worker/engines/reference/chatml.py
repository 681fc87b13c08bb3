"""ChatML turns for the reference engine's reply models (one owner for both backends)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


@dataclass(frozen=True)
class Answer:
    """A one-off question's answer (``ReplyModel.ask``): its text, and the tokens asked and
    generated (for usage)."""

    text: str
    prompt_tokens: int
    output_tokens: int


class ChatML:
    """Tokenizing for a ChatML model; the class using it sets ``tokenizer`` (a transformers
    fast tokenizer) and ``_tokenizer_lock``. The fast tokenizer mutates its settings on every
    call ("Already borrowed" when two engine threads tokenize at once): calls take the lock."""

    tokenizer: Any
    _tokenizer_lock: threading.Lock

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens written in it are recognised), no BOS."""
        with self._tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=False).input_ids

    def turn_ids(self, role: str, content: str) -> list[int]:
        """A ChatML turn. The content is tokenized as plain text, so "<|im_end|>" typed by a
        user or client cannot close the turn or start a role of its own."""
        return [*self.open_turn_ids(role, content), *self.encode(f"{IM_END}\n")]

    def open_turn_ids(self, role: str, content: str) -> list[int]:
        """The start of a ChatML turn, not closed: what ``turn_ids`` begins with."""
        with self._tokenizer_lock:
            plain = self.tokenizer(content, add_special_tokens=False, split_special_tokens=True)
        return [*self.encode(f"{IM_START}{role}\n"), *plain.input_ids]

    def ask_ids(self, turns: Sequence[tuple[str, str]], prefix: str = "") -> list[int]:
        """Closed ChatML turns (role, text), then an open assistant turn that already says
        ``prefix`` (the answer continues it): what ``ReplyModel.ask`` decodes after."""
        ids = [i for role, text in turns for i in self.turn_ids(role, text)]
        return [*ids, *self.open_turn_ids("assistant", prefix)]

    def last_tokens(self, text: str, n: int) -> str:
        """The end of ``text`` in at most ``n`` tokens, from a word's start ("" for n < 1)."""
        text = text.strip()
        if n < 1 or not text:
            return ""
        with self._tokenizer_lock:
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            if len(ids) <= n:
                return text
            tail = self.tokenizer.decode(ids[-n:], clean_up_tokenization_spaces=False)
        # The cut may fall inside a word: the text begins at the next whole one.
        if tail[:1].isspace():
            return tail.strip()
        parts = tail.split(None, 1)
        return parts[1].strip() if len(parts) == 2 else tail.strip()

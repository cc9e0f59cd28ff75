"""Incremental detokenization and stop-string detection.

Text is decoded over a short window of tokens so multi-byte characters split
across tokens are emitted only once complete (a trailing U+FFFD means wait).
"""

from __future__ import annotations

from dataclasses import dataclass

# Tokens decoded before the first new one, so that a tokenizer that joins
# words with a leading space (sentencepiece, byte-level BPE) sees context.
_CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    prompt_token_ids: list[int]
    skip_special_tokens: bool = True
    text: str = ""

    def __post_init__(self):
        self._ids = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (maybe empty)."""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta


def find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string that ends within the
    last `new_chars` characters of `text`, so one spanning token boundaries is
    found as soon as its last piece arrives."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best

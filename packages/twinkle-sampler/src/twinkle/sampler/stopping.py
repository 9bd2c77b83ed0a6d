"""When a completion ends (stop token ids, stop strings) and the text a user sees of it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

# A character takes at most 4 UTF-8 bytes and a byte-level BPE token holds at least one byte, so the
# last ``4 * len(stop) + 1`` tokens (one more for a token the stop string starts in the middle of)
# always decode to text that contains a stop string ending in the newest token.
_BYTES_PER_CHAR = 4


class StopCriteria:
    """Stop token ids (the model's end-of-sequence ids plus ``SamplingParams.stop`` ids) and stop strings.

    A stop token is kept in the completion: the model must learn to emit it.
    Stop strings are matched on the decoded tail after each token; the
    completion keeps the tokens that produced the match, and its visible
    text ends just before the earliest stop string (as vLLM does).
    ``decode`` turns token ids into the text a user sees (special tokens skipped).
    """

    def __init__(
        self, stop_ids: Iterable[int], stop_strings: Sequence[str], decode: Callable[[Sequence[int]], str]
    ) -> None:
        self.stop_ids = frozenset(stop_ids)
        self.stop_strings = tuple(stop_strings)
        self._decode = decode
        longest = max((len(stop) for stop in self.stop_strings), default=0)
        self._tail_tokens = _BYTES_PER_CHAR * longest + 1

    def ends_with_stop_string(self, tokens: Sequence[int]) -> bool:
        """Whether the decoded completion now contains a stop string (checked after every new token)."""
        if not self.stop_strings:
            return False
        tail = self._decode(tokens[-self._tail_tokens :])
        return any(stop in tail for stop in self.stop_strings)

    def visible_text(self, tokens: Sequence[int]) -> str:
        """The completion's text, cut before the earliest stop string."""
        text = self._decode(tokens)
        positions = [text.find(stop) for stop in self.stop_strings]
        return text[: min((p for p in positions if p >= 0), default=len(text))]

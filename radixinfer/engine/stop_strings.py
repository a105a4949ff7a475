"""Stop strings: finding them in a completion's text as it grows, token by token, and how much of
the text a stream may send before it is known not to begin one (vLLM's hold-back)."""

from __future__ import annotations


class StopStrings:
    """The stop strings of one request (non-empty, as `SamplingParams` checks them).

    A stop string may be split over any number of tokens, so each search covers the new text plus
    the ``longest - 1`` characters before it: a match that ends in the new text is found however it
    straddles the tokens, and the earliest one wins. A stream holds back the end of the text that
    could still become a stop string (the longest suffix that is a proper prefix of one), so it
    never sends text that a later token turns into part of a stop string."""

    def __init__(self, strings: tuple[str, ...], include_in_output: bool) -> None:
        self.strings = strings
        self.include_in_output = include_in_output
        self.longest = max(map(len, strings))

    def find(self, text: str, num_new: int) -> tuple[str, int] | None:
        """The earliest stop string of ``text`` that ends within its last ``num_new`` characters, as
        ``(string, length of text to keep)``, or None."""
        start = max(0, len(text) - num_new - self.longest + 1)
        best: tuple[int, str] | None = None
        for string in self.strings:
            at = text.find(string, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, string)
        if best is None:
            return None
        at, string = best
        return string, at + len(string) if self.include_in_output else at

    def held_back(self, text: str) -> int:
        """How many characters at the end of ``text`` may begin a stop string (held back)."""
        for size in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-size:]
            if any(string.startswith(tail) for string in self.strings):
                return size
        return 0

"""Text out of token streams: incremental detokenization and stop strings.

Stop strings can straddle token boundaries, so text that might be the start
of a stop string is held back until it is known not to be:

    stop = "END",  emitted so far: "the E"  ->  "the " out, "E" held
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string matched; the text before it is all there is


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: list[str]):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self._stop = [s for s in stop if s]
        self._held = ""
        self.text = ""
        self.stopped = False

    def add(self, token_ids: list[int]) -> TextDelta:
        if self._detok is None or self.stopped:
            return TextDelta("", self.stopped)
        return self._push(self._detok.add(token_ids))

    def finish(self) -> TextDelta:
        """At the end of the stream: flush what the detokenizer and the stop check held."""
        if self._detok is None or self.stopped:
            return TextDelta("", self.stopped)
        delta = self._push(self._detok.flush())
        if delta.stopped:
            return delta
        rest, self._held = self._held, ""
        self.text += rest
        return TextDelta(delta.text + rest, False)

    def _push(self, new_text: str) -> TextDelta:
        pending = self._held + new_text
        matches = [(pending.find(s), s) for s in self._stop if s in pending]
        if matches:
            cut = min(index for index, _ in matches)
            out = pending[:cut]
            self._held = ""
            self.text += out
            self.stopped = True
            return TextDelta(out, True)
        keep = _longest_stop_prefix_suffix(pending, self._stop)
        out = pending[: len(pending) - keep]
        self._held = pending[len(pending) - keep :]
        self.text += out
        return TextDelta(out, False)


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that begins some stop string."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if stop.startswith(text[-length:]):
                best = length
                break
    return best

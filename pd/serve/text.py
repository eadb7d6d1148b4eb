"""Text out of token streams: incremental detokenization and stop strings.

Stop strings can straddle token boundaries, so text that might be the start
of a stop string is held back until it is known not to be:

    stop = "END",  emitted so far: "the E"  ->  "the " out, "E" held

Each stop string is matched by its own KMP automaton, fed only the new text:
a step costs the new characters times the number of stop strings, whatever
the length of the stop strings or of the text so far. The longest partial
match across the automata is exactly what must be held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string matched; the text before it is all there is


class StopMatcher:
    """Where one stop string first occurs in a stream of text, seen piece by piece."""

    def __init__(self, stop: str):
        self.stop = stop
        self.state = 0  # the longest prefix of ``stop`` that the text seen so far ends with
        # fallback[i]: the longest proper prefix of stop[:i + 1] that is also its suffix.
        self._fallback = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._fallback[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._fallback[i] = k

    def feed(self, text: str) -> int | None:
        """Advance over ``text``; the index in ``text`` just past the first full match, if any."""
        stop, k = self.stop, self.state
        for index, char in enumerate(text):
            while k and char != stop[k]:
                k = self._fallback[k - 1]
            if char == stop[k]:
                k += 1
            if k == len(stop):
                self.state = k
                return index + 1
        self.state = k
        return None


class StopStrings:
    """Text pushed piece by piece, cut before the first stop string and held back where one may begin."""

    def __init__(self, stop: list[str]):
        self._matchers = [StopMatcher(s) for s in stop if s]
        self._held = ""
        self.stopped = False

    def push(self, new_text: str) -> TextDelta:
        """The text now known to be out, and whether a stop string ended it."""
        if self.stopped:
            return TextDelta("", True)
        pending = self._held + new_text
        # The first stop string to be complete wins (the earliest end; then the earliest start), as if
        # the text had come one character at a time: generation stops there, so a longer stop string
        # that began earlier but would end later never completes. A match may start in the held text.
        found = [(end, end - len(m.stop)) for m in self._matchers if (end := m.feed(new_text)) is not None]
        if found:
            cut = len(self._held) + min(found)[1]
            self._held, self.stopped = "", True
            return TextDelta(pending[:cut], True)
        keep = max((m.state for m in self._matchers), default=0)
        self._held = pending[len(pending) - keep :]
        return TextDelta(pending[: len(pending) - keep], False)

    def finish(self) -> TextDelta:
        """The text held back: at the end of the stream it is known not to start a stop string."""
        rest, self._held = self._held, ""
        return TextDelta("" if self.stopped else rest, self.stopped)


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: list[str]):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self._stops = StopStrings(stop)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def has_stops(self) -> bool:
        """Stop strings may end the text (and a text to check them on exists)."""
        return self._detok is not None and bool(self._stops._matchers)

    def add(self, token_ids: list[int]) -> TextDelta:
        if self._detok is None or self.stopped:
            return TextDelta("", self.stopped)
        return self._emit(self._stops.push(self._detok.add(token_ids)))

    def finish(self) -> TextDelta:
        """At the end of the stream: flush what the detokenizer and the stop check held."""
        if self._detok is None or self.stopped:
            return TextDelta("", self.stopped)
        delta = self._stops.push(self._detok.flush())
        if delta.stopped:
            return self._emit(delta)
        return self._emit(TextDelta(delta.text + self._stops.finish().text, False))

    def _emit(self, delta: TextDelta) -> TextDelta:
        self.text += delta.text
        return delta

"""Stop strings over text that arrives piece by piece (printed tokens, offline answers).

A stop string can span pieces, so text that could still be the start of one is held back until it
cannot; the stop string itself is left out of the output, as OpenAI does.
"""

from __future__ import annotations


class StopFilter:
    """Generated text in, the text to emit out: everything before the first stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [stop for stop in stops if stop]
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self._held += text
        found = [i for i in (self._held.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self._held = self._held[:min(found)], ""
            return out
        cut = max(len(self._held) - max((len(stop) - 1 for stop in self.stops), default=0), 0)
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def flush(self) -> str:
        """What was held back, once generation ended without a stop string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


def stop_streamer(tokenizer, stops: list[str]):
    """transformers' TextStreamer, printing only the text before the first stop string."""
    from transformers import TextStreamer

    class StopStreamer(TextStreamer):
        def __init__(self):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.filter = StopFilter(stops)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            shown = self.filter.feed(text) + (self.filter.flush() if stream_end else "")
            super().on_finalized_text(shown, stream_end=stream_end)

    return StopStreamer()

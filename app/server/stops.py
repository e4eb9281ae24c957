"""Stop strings over streamed text: text is released only once it cannot be the start of a stop."""

from __future__ import annotations

from collections.abc import Sequence


class StopScanner:
    """Feed text pieces with `push`; each returns (text safe to emit, whether a stop was hit).

    After a hit the text up to (not including) the earliest stop string has been emitted and
    everything later is dropped. `flush` releases the held-back tail at the end of a turn."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.hit = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.hit:
            return "", True
        buf = self.held + text
        found = [i for i in (buf.find(s) for s in self.stops) if i != -1]
        if found:
            self.held, self.hit = "", True
            return buf[:min(found)], True
        keep = 0
        for s in self.stops:  # the longest tail of buf that starts some stop string
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out

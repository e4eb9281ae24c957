"""A bounded pool of engine sessions, so that a request extending an earlier conversation reuses
that conversation's KV state.

A request is (system prompt, earlier messages, new user message). `checkout` picks the pooled
session with the same system prompt whose messages best match the earlier messages (compared by
role and content; reasoning is not rendered for earlier turns, so it is not compared):

* a session whose whole conversation is a prefix of the request's (the client is continuing it):
  the longest such one;
* otherwise the session sharing the longest common prefix of at least one message (a retry or
  an edited turn: that session branches, its later turns are replaced);
* otherwise a new session.

The chosen session's messages are set to the request's earlier messages; `Engine.generate` then
reuses the longest kept state whose rendered text is a prefix of the new prompt (engine.session),
so correctness never depends on this matching, only the amount reused does. After a turn,
`checkin` marks the session most recently used and evicts least recently used sessions beyond
`max_sessions` or beyond `max_bytes` of state (the just-used one is kept). `max_sessions=0`
disables reuse: every request runs in a fresh session that is dropped afterwards.

Only the worker thread calls checkout/checkin; `stats` may be called from any thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import count

from engine.chat import Message


def _common(a: Sequence[Message], b: Sequence[Message]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x.role != y.role or x.content != y.content:
            break
        n += 1
    return n


class SessionPool:
    """LRU pool of `Session`s of one engine (see the module docstring)."""

    def __init__(self, engine, max_sessions: int = 4, max_bytes: int | None = None) -> None:
        if max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {max_sessions}")
        self.engine, self.max_sessions, self.max_bytes = engine, max_sessions, max_bytes
        self._sessions: OrderedDict[int, object] = OrderedDict()  # id -> Session, least recent first
        self._ids = count(1)
        self._lock = threading.Lock()
        self._summary = {"sessions": 0, "state_bytes": 0, "evictions": 0, "matched": 0, "new": 0}

    def checkout(self, system: str | None, history: Sequence[Message]):
        """(key, session) to run the next turn of this conversation in; its messages are `history`."""
        best_key, best_score = None, (0, 0)
        for key, session in self._sessions.items():
            if session.system != (system or None):
                continue
            n = _common(session.messages, history)
            if n == 0 and session.messages:
                continue
            extends = n == len(session.messages)
            score = (1 if extends else 0, n)
            if score >= best_score:  # later entries are more recent: ties go to them
                best_key, best_score = key, score
        if best_key is None:
            key, session = next(self._ids), self.engine.new_session(system=system)
            self._count("new")
        else:
            key, session = best_key, self._sessions[best_key]
            self._count("matched")
        session.messages = list(history)
        return key, session

    def checkin(self, key: int, session) -> None:
        """Keep `session` as the most recently used; evict beyond the bounds."""
        with self._lock:
            if self.max_sessions == 0:
                self._sessions.pop(key, None)
            else:
                self._sessions[key] = session
                self._sessions.move_to_end(key)
            while len(self._sessions) > max(self.max_sessions, 0) or (
                    self.max_bytes is not None and len(self._sessions) > 1 and self._bytes() > self.max_bytes):
                self._sessions.popitem(last=False)
                self._summary["evictions"] += 1
            self._summary["sessions"] = len(self._sessions)
            self._summary["state_bytes"] = self._bytes()

    def _bytes(self) -> int:
        return sum(s.nbytes() for s in self._sessions.values())

    def _count(self, what: str) -> None:
        with self._lock:
            self._summary[what] += 1

    def stats(self) -> dict:
        """Sessions held, their state bytes (as of the last turn), evictions, matched/new requests."""
        with self._lock:
            return dict(self._summary, max_sessions=self.max_sessions, max_bytes=self.max_bytes)

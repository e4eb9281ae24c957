"""IOPool: an owned pool of named I/O threads for expert reads (started and stopped explicitly).

    pool = IOPool(2).start()          # threads "dsv4-io-0", "dsv4-io-1"
    fut = pool.submit(store.read_into, layer, expert, buf)   # concurrent.futures.Future
    pool.close()                      # finishes queued work, joins every thread

Work items run in submission order per thread; a failing item sets its future's exception and
the thread carries on. `pending` counts the items submitted and not yet finished (a background
reader yields to them). After `close` nothing can be submitted.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

_STOP = object()


class IOPool:
    """A fixed number of named worker threads consuming one FIFO queue."""

    def __init__(self, threads: int = 2, name: str = "dsv4-io"):
        if threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {threads}")
        self.name, self.size = name, threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._state = "new"
        self._lock = threading.Lock()  # guards _pending
        self._pending = 0

    def start(self) -> "IOPool":
        if self._state != "new":
            raise RuntimeError(f"IOPool {self.name} is {self._state}; start it once")
        self._threads = [threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                         for i in range(self.size)]
        for t in self._threads:
            t.start()
        self._state = "running"
        return self

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._state != "running":
            raise RuntimeError(f"IOPool {self.name} is {self._state}; cannot submit")
        fut: Future = Future()
        with self._lock:
            self._pending += 1
        self._queue.put((fut, fn, args))
        return fut

    @property
    def pending(self) -> int:
        """Items submitted and not yet finished (queued or running)."""
        return self._pending

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fut, fn, args = item
            try:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # delivered to whoever waits on the future
                    fut.set_exception(e)
            finally:
                with self._lock:
                    self._pending -= 1

    def threads(self) -> list[str]:
        """Names of the live worker threads."""
        return [t.name for t in self._threads if t.is_alive()]

    def close(self) -> None:
        """Run what is queued, then stop and join every thread. Idempotent."""
        if self._state != "running":
            self._state = "closed"
            return
        self._state = "closing"
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join()
        self._threads = []
        self._state = "closed"

    def __enter__(self) -> "IOPool":
        return self if self._state == "running" else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

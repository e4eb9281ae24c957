"""A fake engine implementing the Engine facade contract (engine/engine.py) for app tests.

It streams a canned answer word by word, yields StepUpdates built from the real
engine.stats dataclasses, honours `cancel` between steps, and keeps a small fake expert cache
(LFU eviction, pinning, flush) whose counters feed the snapshots. `FakeBackend` is the app's
backend seam around it (loading, sampling params, conversion and the demo model).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from app.backend import RealBackend
from converter.convert import ConvertCancelled, ConvertProgress
from engine.chat import Message
from engine.events import EngineFailure, LoadProgress, StepUpdate, TextDelta, TurnFinished
from engine.sampling import SamplingParams
from engine.stats import CacheSnapshot, MemoryBudget, StepStats, StepTiming, TurnStats

GiB = 2**30
ANSWER = ("Mixture-of-experts models route each token to a few experts, so only a small "
          "part of the weights is needed per step. **Streaming** them from disk works when "
          "the cache keeps the hot experts resident.")
THINKING = "The user asks about experts. I should explain routing briefly."


@dataclass
class FakeSession:
    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    position: int = 0


class FakeEngine:
    """Deterministic stand-in for engine.engine.Engine (an app.backend.EngineLike: same methods, same
    event types)."""

    def __init__(self, answer: str = ANSWER, thinking: str = THINKING, step_delay: float = 0.0,
                 first_token_delay: float = 0.0, graphs: bool = True,
                 n_layers: int = 4, n_experts: int = 16, capacity_entries: int = 24,
                 expert_bytes: int = 8 * 2**20, top_k: int = 2) -> None:
        self.answer = answer
        self.thinking = thinking
        self.step_delay = step_delay
        self.first_token_delay = first_token_delay  # prefill time before the first token
        self.graphs = graphs  # Engine.info's decode mode ("CUDA graphs" or "eager")
        self.n_layers, self.n_experts, self.top_k = n_layers, n_experts, top_k
        self.capacity_entries = capacity_entries
        self.expert_bytes = expert_bytes
        self.calls: list[tuple[str, SamplingParams]] = []  # (user text or "<regen>", params)
        self.closed = False
        self.fail_next: str | None = None  # message of an EngineFailure for the next turn
        self._lock = threading.Lock()
        self._rng = random.Random(0)
        self._cache: dict[tuple[int, int], int] = {}  # key -> uses while resident
        self._pinned: set[tuple[int, int]] = set()
        self._uses = Counter()  # key -> uses over all time
        self._hits = self._misses = self._evictions = self._bytes_read = 0
        self._layer_hits = [0] * n_layers
        self._layer_lookups = [0] * n_layers
        self._window: deque[bool] = deque(maxlen=64)
        self._step = 0
        self._position = 0
        self._phase = "warm-up"
        self._ttft: float | None = None

    # ---- facade: sessions and turns -------------------------------------------------------

    @property
    def info(self) -> dict:
        return {"model": "fake-dsv4", "n_layers": self.n_layers, "n_experts": self.n_experts,
                "demo": False, "device": "cpu", "numerics": "exact",
                "decode": "CUDA graphs" if self.graphs else "eager"}

    def new_session(self, system: str | None = None, history: list[Message] = ()) -> FakeSession:
        return FakeSession(system, list(history), sum(len(m.content.split()) for m in history))

    def generate(self, session: FakeSession, user_text: str, params: SamplingParams,
                 cancel: threading.Event) -> Iterator:
        self.calls.append((user_text, params))
        return self._turn(session, user_text, params, cancel, self.answer)

    def regenerate(self, session: FakeSession, params: SamplingParams,
                   cancel: threading.Event) -> Iterator:
        self.calls.append(("<regen>", params))
        if not session.messages or session.messages[-1].role != "assistant":
            raise ValueError("nothing to regenerate")
        user = session.messages[-2].content
        return self._turn(session, user, params, cancel, "Regenerated: " + self.answer, replace=True)

    def undo(self, session: FakeSession) -> None:
        for i in range(len(session.messages) - 1, -1, -1):
            if session.messages[i].role == "user":
                del session.messages[i:]
                return
        raise ValueError("nothing to undo")

    def _turn(self, sess: FakeSession, text: str, params: SamplingParams,
              cancel: threading.Event, answer: str, replace: bool = False) -> Iterator:
        """One turn; the session changes only at the end (a failure leaves it as it was)."""
        if self.fail_next is not None:
            message, self.fail_next = self.fail_next, None
            yield EngineFailure(message)
            return
        t0 = time.monotonic()
        prompt_tokens = len(text.split()) + 4
        self._ttft = None
        yield StepUpdate(self._step_stats(prompt_tokens, "eager"))
        if self.first_token_delay:
            time.sleep(self.first_token_delay)
        deltas = [(w, "thinking") for w in self._words(self.thinking)] if params.thinking else []
        deltas += [(w, "answer") for w in self._words(answer)]
        reasoning, content, finish, n = "", "", "max_tokens", 0
        for piece, channel in deltas:
            if n >= params.max_tokens:
                break
            if cancel.is_set():
                finish = "cancelled"
                break
            if self.step_delay:
                time.sleep(self.step_delay)
            step = "graph replay" if self.graphs else "eager"
            n += 1
            if self._ttft is None:
                self._ttft = 0.25
            if channel == "thinking":
                reasoning += piece
            else:
                content += piece
            yield TextDelta(piece, channel)
            yield StepUpdate(self._step_stats(1, step))
        else:
            finish = "eos"
        if replace:  # regenerate: the new answer takes the old one's place
            del sess.messages[-2:]
        sess.messages += [Message("user", text), Message("assistant", content, reasoning)]
        sess.position = self._position
        elapsed = time.monotonic() - t0
        stats = TurnStats(prompt_tokens=prompt_tokens, completion_tokens=n, prefill_s=0.01,
                          decode_s=elapsed, ttft_s=0.25, tok_per_s=10.0 + n / 10,  # not a step rate
                          finish_reason=finish, cache=self._snapshot())
        yield TurnFinished(stats, reasoning, content)

    @staticmethod
    def _words(text: str) -> list[str]:
        words = text.split(" ")
        return [w + " " for w in words[:-1]] + words[-1:]

    # ---- facade: cache control ------------------------------------------------------------

    def flush_cache(self) -> int:
        with self._lock:
            victims = [k for k in self._cache if k not in self._pinned]
            for k in victims:
                del self._cache[k]
            return len(victims)

    def pin(self, keys: list[tuple[int, int]]) -> None:
        with self._lock:
            for layer, expert in keys:
                if not (0 <= layer < self.n_layers and 0 <= expert < self.n_experts):
                    raise ValueError(f"no expert {layer}:{expert} (layers 0-{self.n_layers - 1}, "
                                     f"experts 0-{self.n_experts - 1})")
            for key in keys:
                self._load(key)
                self._pinned.add(key)

    def pin_hot(self, n: int) -> list[tuple[int, int]]:
        hot = [k for k, _ in sorted(self._uses.items(), key=lambda kv: (-kv[1], kv[0]))][:n]
        self.pin(hot)
        return hot

    def unpin(self, keys: list[tuple[int, int]] | None = None) -> None:
        with self._lock:
            if keys is None:
                self._pinned.clear()
            else:
                self._pinned.difference_update(keys)

    def cache_contents(self) -> list[tuple[int, int, bool, int]]:
        with self._lock:
            return [(l, e, (l, e) in self._pinned, u) for (l, e), u in sorted(self._cache.items())]

    def stats(self) -> StepStats:
        return self._stats(0)

    def close(self) -> None:
        self.closed = True

    # ---- the fake cache -------------------------------------------------------------------

    def _load(self, key: tuple[int, int]) -> bool:
        """Make `key` resident (evicting the least used unpinned entry); False if all pinned."""
        if key in self._cache:
            return True
        if len(self._cache) >= self.capacity_entries:
            unpinned = [k for k in self._cache if k not in self._pinned]
            if not unpinned:
                return False
            victim = min(unpinned, key=lambda k: (self._cache[k], k))
            del self._cache[victim]
            self._evictions += 1
        self._cache[key] = 0
        self._bytes_read += self.expert_bytes
        return True

    def _route(self, tokens: int) -> None:
        with self._lock:
            for _ in range(tokens):
                for layer in range(self.n_layers):
                    for _ in range(self.top_k):
                        key = (layer, int(self._rng.paretovariate(1.0)) % self.n_experts)
                        hit = key in self._cache
                        self._hits += hit
                        self._misses += not hit
                        self._layer_hits[layer] += hit
                        self._layer_lookups[layer] += 1
                        self._window.append(hit)
                        self._uses[key] += 1
                        if self._load(key):
                            self._cache[key] += 1

    def _step_stats(self, tokens: int, phase: str) -> StepStats:
        self._route(tokens)
        self._step += 1
        self._position += tokens
        self._phase = phase
        return self._stats(tokens)

    def _tok_per_s(self) -> float:
        return 20.0 + (self._step % 7)

    def _snapshot(self) -> CacheSnapshot:
        with self._lock:
            looked = self._hits + self._misses
            return CacheSnapshot(
                capacity_bytes=self.capacity_entries * self.expert_bytes,
                used_bytes=len(self._cache) * self.expert_bytes,
                entries=len(self._cache), capacity_entries=self.capacity_entries,
                pinned=len(self._pinned), hits=self._hits, misses=self._misses,
                evictions=self._evictions, bytes_read=self._bytes_read,
                hit_rate=self._hits / looked if looked else 0.0,
                hit_rate_window=sum(self._window) / len(self._window) if self._window else 0.0,
                per_layer_hit_rate=tuple(h / n if n else 0.0
                                         for h, n in zip(self._layer_hits, self._layer_lookups)),
            )

    def _stats(self, tokens: int) -> StepStats:
        cache = self._snapshot()
        parts = (("resident weights", 8 * GiB), ("expert cache", cache.capacity_bytes),
                 ("kv/state", GiB), ("workspace", GiB // 2), ("framework", GiB))
        total = 64 * GiB
        free = total - sum(size for _, size in parts)
        return StepStats(
            phase=self._phase, tokens=tokens, position=self._position,
            timing=StepTiming(attention_ms=1.5, moe_ms=2.5, expert_wait_ms=0.5, other_ms=0.5),
            tok_per_s=self._tok_per_s() if self._step > 1 else 0.0, ttft_s=self._ttft,
            cache=cache, memory=MemoryBudget(False, total, parts + (("free", free),)),
            read_bytes_per_s=float(self.expert_bytes * 10),
        )


class FakeBackend(RealBackend):
    """The app's Backend seam around a FakeEngine, with fake conversion / demo building (the
    sampling params and messages are the real ones)."""

    def __init__(self, engine: FakeEngine | None = None, problems: dict[str, list[str]] | None = None,
                 convert_delay: float = 0.0, fail_load: dict[str, str] | None = None) -> None:
        self.engine = engine or FakeEngine()
        self.loaded: list[Path] = []
        self.fail_load = fail_load or {}  # model dir (str) -> the load error's message
        self.problems = problems or {}
        self.convert_delay = convert_delay

    def load_engine(self, model_dir: Path, config, progress) -> FakeEngine:
        for i in range(3):
            progress(LoadProgress("loading", i + 1, 3, "layers"))
        if str(model_dir) in self.fail_load:
            raise RuntimeError(self.fail_load[str(model_dir)])
        self.loaded.append(model_dir)
        return self.engine

    def check_source(self, path: Path) -> list[str]:
        return self.problems.get(str(path), [] if (path / "config.json").is_file()
                                 else [f"{path}: no config.json"])

    def convert(self, src: Path, dst: Path, progress, cancel: threading.Event) -> Path:
        total = 4 * GiB
        for i in range(1, 5):
            if cancel.is_set():
                raise ConvertCancelled("conversion cancelled; run it again to resume")
            time.sleep(self.convert_delay)
            progress(ConvertProgress(i * GiB, total, 512.0 * 2**20, (4 - i) * 2.0,
                                     f"layer_{i:02d}.safetensors"))
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "manifest.json").write_text("{}")
        return dst

    def ensure_demo(self, data_dir: Path, progress) -> Path:
        out = data_dir / "models" / "demo"
        out.mkdir(parents=True, exist_ok=True)
        (out / "manifest.json").write_text("{}")
        progress(LoadProgress("converting", 1, 1, "files"))
        return out

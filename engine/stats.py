"""Immutable statistics snapshots the engine publishes to the app and to benchmarks.

Every snapshot is a frozen dataclass built from the engine's own counters at one instant, so a
consumer (the UI thread, a benchmark) can keep it without locking and a newer snapshot simply
replaces an older one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierSnapshot:
    """The pinned host-RAM tier behind a device cache (engine/experts/host_tier.py): its fill,
    and where the device cache's misses came from (RAM hits; disk reads, the tier's misses)."""

    capacity_bytes: int
    used_bytes: int
    entries: int
    capacity_entries: int
    ram_hits: int
    disk_reads: int
    hit_rate: float  # ram_hits / (ram_hits + disk_reads), 0 when nothing was looked up
    filling: bool = False  # its background fill (engine/experts/tier_fill.py) is still reading
    fill_error: str | None = None  # why that fill stopped early (a record that failed to read)


@dataclass(frozen=True)
class CacheSnapshot:
    """Expert-cache state: fill, hit rates and I/O, straight from the cache's counters."""

    capacity_bytes: int
    used_bytes: int
    entries: int
    capacity_entries: int
    pinned: int
    hits: int
    misses: int
    evictions: int  # experts evicted: for capacity by the cache, and by /flush
    bytes_read: int
    hit_rate: float  # cumulative, 0..1 (0 when nothing was looked up)
    hit_rate_window: float  # over the last `window` lookups
    per_layer_hit_rate: tuple[float, ...] = ()  # one value per layer, cumulative
    tier: TierSnapshot | None = None  # the host-RAM tier behind the cache, if there is one


@dataclass(frozen=True)
class MemoryBudget:
    """Where the memory goes, in bytes. `parts` add up to `total`; `free` is one of them.

    On unified-memory machines (CPU and GPU share one pool, e.g. GB10 or a CPU-only run) the
    pool is the system RAM, `MemAvailable` is the truth for `free` and `page_cache` is shown
    separately (it is reclaimable). On discrete GPUs the pool is the device memory.
    """

    unified: bool
    total: int
    parts: tuple[tuple[str, int], ...]  # (name, bytes) in display order, "free" last
    page_cache: int = 0
    plan: str = ""  # the memory plan in one line (engine.memory_plan.MemoryPlan.summary), if any

    def part(self, name: str) -> int:
        return dict(self.parts).get(name, 0)


@dataclass(frozen=True)
class StepTiming:
    """Milliseconds of one step split by where the time went. A step replayed from CUDA graphs
    cannot be split into attention and MoE: its GPU work is `graph_ms` (the rest stays 0)."""

    attention_ms: float = 0.0
    moe_ms: float = 0.0
    expert_wait_ms: float = 0.0  # the host blocked on expert reads (engine.experts.provider.ExpertUsage.wait_s)
    other_ms: float = 0.0
    graph_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.attention_ms + self.moe_ms + self.expert_wait_ms + self.other_ms + self.graph_ms

    def lines(self) -> tuple[str, str]:
        """Two display lines: the split, or (for a replayed step) the graph and the expert wait."""
        if self.graph_ms:
            return (f"step {self.total_ms:.1f} ms: CUDA graph {self.graph_ms:.1f}",
                    f"expert wait {self.expert_wait_ms:.1f}")
        return (f"step {self.total_ms:.1f} ms: attn {self.attention_ms:.1f} · moe {self.moe_ms:.1f}",
                f"expert wait {self.expert_wait_ms:.1f} · other {self.other_ms:.1f}")


@dataclass(frozen=True)
class StepStats:
    """Snapshot after one prefill chunk or decode step."""

    phase: str  # "loading" | "warm-up" | "graph capture" | "graph replay" | "eager" | "converting"
    tokens: int  # tokens processed by this step (prefill chunk length, or 1)
    position: int  # sequence length after the step
    timing: StepTiming
    tok_per_s: float  # decode tokens per second over a recent window (0 before the first)
    ttft_s: float | None  # time to first token of the current turn, once known
    cache: CacheSnapshot
    memory: MemoryBudget
    read_bytes_per_s: float = 0.0  # expert read bandwidth over the recent window


@dataclass(frozen=True)
class TurnStats:
    """Summary of one finished turn."""

    prompt_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float
    ttft_s: float
    tok_per_s: float  # decode steps / decode time (a step: sample a token + run it)
    finish_reason: str  # "eos" | "max_tokens" | "context" (hit max_seq_len) | "cancelled" | "error"
    cache: CacheSnapshot | None = None
    step_ms: tuple[float, ...] = field(default=())  # per decode step, for sparklines
    prefill_tokens: int = 0  # prompt tokens actually run this turn (the rest was reused)
    reused_tokens: int = 0  # prompt tokens whose state was kept from earlier turns


def cache_snapshot(cache, args, layer_uses: list[int], tier=None, fill=None) -> CacheSnapshot:
    """The expert-cache figures the app shows: from `cache` (engine.experts.cache.ExpertCache),
    the host-RAM `tier` behind it (engine.experts.host_tier.HostTier, or None) and the tier's
    background `fill` (engine.experts.tier_fill.TierFill, or None), or, when every expert is
    resident without a cache (None), from the per-layer use counts."""
    if cache is not None:
        s = cache.stats()
        t = None if tier is None else tier.stats()
        return CacheSnapshot(capacity_bytes=s.capacity_entries * s.entry_bytes, used_bytes=s.used_bytes,
                             entries=s.entries, capacity_entries=s.capacity_entries, pinned=s.pinned,
                             hits=s.hits, misses=s.misses, evictions=s.evictions + s.flushed, bytes_read=s.bytes_read,
                             hit_rate=s.hit_rate, hit_rate_window=s.hit_rate_window,
                             # the main layers only: the MTP block's slot row is never routed
                             per_layer_hit_rate=s.per_layer_hit_rate[:args.n_layers],
                             tier=None if t is None else TierSnapshot(
                                 capacity_bytes=t.capacity_entries * t.entry_bytes, used_bytes=t.used_bytes,
                                 entries=t.entries,
                                 capacity_entries=t.capacity_entries, ram_hits=t.hits, disk_reads=t.misses,
                                 hit_rate=t.hit_rate, filling=fill is not None and fill.running,
                                 fill_error=None if fill is None else fill.error))
    n = args.n_layers * args.n_routed_experts
    total = n * args.expert_record_bytes()
    hits = sum(layer_uses)
    return CacheSnapshot(capacity_bytes=total, used_bytes=total, entries=n, capacity_entries=n, pinned=0,
                         hits=hits, misses=0, evictions=0, bytes_read=0, hit_rate=1.0 if hits else 0.0,
                         hit_rate_window=1.0 if hits else 0.0,
                         per_layer_hit_rate=tuple(1.0 if u else 0.0 for u in layer_uses))

"""The static one-token decode step (`Block.decode_attention` / `decode_ffn`, run by
`engine.decode_graph.DecodeRunner`) against `Transformer.forward` on the CPU: same logits and state across window wrap-around,
compressed-entry emission (ratios 4 and 128) and capacity growth, in both numerics; layered
mode streams through a bounded cache; whole mode counts statistics. (CUDA graphs themselves are
exercised by tests/engine/test_decode_graph_gpu.py.)"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.decode_graph import DecodeRunner, make_runner
from engine.experts.cache import CacheFullError
from engine.lanes import Lanes
from engine.model import Transformer
from engine.numerics import Numerics
from engine.weights import open_model

PROMPT = [0, 17, 300, 5, 5, 99, 511, 42, 8, 250, 17, 3, 77]


def _pair(files, numerics: str, steps: int, whole: bool = True):
    """Greedy decode `steps` tokens twice from one prefill: forward(S=1) vs the runner."""
    model = Transformer(files.get, files.args, Numerics.named(numerics))
    ref_state = model.new_state()
    first = model.forward(torch.tensor(PROMPT), ref_state, files.experts, last_only=True)
    state = ref_state.clone()
    runner = DecodeRunner(model, files.experts, whole=whole)
    tok = first.argmax(-1)
    pairs = []
    for _ in range(steps):
        a = model.forward(tok, ref_state, files.experts, last_only=True)
        b = runner.step(state, tok)
        pairs.append((a, b))
        tok = a.argmax(-1)
    return model, ref_state, state, pairs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def test_decode_step_equals_forward_exact(files):
    model, ref_state, state, pairs = _pair(files, "exact", 140)  # positions 13..152: 128 crossed
    assert max(_rel(a, b) for a, b in pairs) <= 1e-5
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in pairs)
    assert state.pos == ref_state.pos == len(PROMPT) + 140
    for i, (r, s) in enumerate(zip(ref_state.layers, state.layers)):
        torch.testing.assert_close(s.window, r.window, rtol=1e-5, atol=1e-6)
        ratio = files.args.ratio(i)
        if ratio:
            n = state.pos // ratio  # complete entries; later slots may hold a partial one
            assert s.capacity >= n + 1
            if ratio == 4:
                assert s.capacity > 16  # grew past the initial 16 entries while decoding
            torch.testing.assert_close(s.compressor.entries[:n], r.compressor.entries[:n], rtol=1e-5, atol=1e-6)


class _WhereLanes(Lanes):
    """In-place lanes that remember, for each call a test wraps, whether it ran on a side lane;
    and, through `_LaneInputs`, weak references to what the side blocks read that was made off
    the lanes, which every `join` checks: such a tensor must stay referenced until the join (on
    CUDA the stream that made it could otherwise reuse its memory while the lane still reads it;
    what a lane made itself is reused only by that lane's later work)."""

    def __init__(self):
        super().__init__(None)
        self.depth, self.log, self.pending, self.made, self.freed_early = 0, [], [], [], []

    @contextmanager
    def side(self, lane: int = 0):
        self.depth += 1
        try:
            with super().side(lane):
                yield
        finally:
            self.depth -= 1

    def join(self) -> None:
        self.freed_early += [name for name, ref in self.pending if ref() is None]
        self.pending.clear()
        self.made.clear()
        super().join()

    def wrap(self, name: str, fn):
        def call(*args, **kwargs):
            self.log.append((name, self.depth > 0))
            return fn(*args, **kwargs)
        return call


def test_a_csa_layers_index_projection_is_on_the_chain_and_its_scores_beside(files):
    """The index queries' wq_b runs on the step's chain right after the q norm (its weights load
    during the norm; on a side lane it waited for SM room behind the attention's wq_b), after it
    on the chain the attention's wq_b; their RoPE, rounding and picks run on side lane 0."""
    model = Transformer(files.get, files.args, Numerics.named("native"))
    lanes = _WhereLanes()
    csa = [b.attn for b in model.blocks if b.attn.indexer is not None]
    assert csa, "the tiny model has CSA layers"
    for attn in csa:  # test doubles on the instances, so the calls are logged in order
        attn.indexer.wq_b = lanes.wrap("index wq_b", attn.indexer.wq_b)
        attn.indexer.rotated = lanes.wrap("index rotated", attn.indexer.rotated)
        attn.indexer.picks = lanes.wrap("index picks", attn.indexer.picks)
        attn.wq_b = lanes.wrap("wq_b", attn.wq_b)
    state = model.new_state()
    model.forward(torch.tensor(PROMPT), state, files.experts, last_only=True)
    lanes.log.clear()
    DecodeRunner(model, files.experts, whole=True, lanes=lanes).step(state, torch.tensor([5]))
    per_layer = [("index wq_b", False), ("index rotated", True), ("index picks", True), ("wq_b", False)]
    assert lanes.log == per_layer * len(csa)


class _LaneInputs(TorchFunctionMode):
    """Every torch op run inside a side block of `lanes`: weak references to the storage owners
    (a view's base) of its tensor inputs that no op of the block made, which `lanes`' joins
    check (`_WhereLanes.freed_early`, named by the op)."""

    def __init__(self, lanes: _WhereLanes):
        super().__init__()
        self.lanes, self.ops = lanes, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        lanes = self.lanes
        if not lanes.depth:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        self.ops.add(name)
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor):
                    owner = t if t._base is None else t._base
                    if not any(r() is t or r() is owner for r in lanes.made):
                        lanes.pending.append((name, weakref.ref(owner)))
        out = func(*args, **kwargs)
        lanes.made += [weakref.ref(t) for t in (out if isinstance(out, (list, tuple)) else (out,))
                       if isinstance(t, torch.Tensor)]
        return out


def test_what_the_side_lanes_read_stays_referenced_until_the_join(files):
    """Every tensor made off the side lanes that an op on them reads (the compressors, the
    indexer's weights, scores and picks, the key rows, the shared expert), in a decode step and a
    chunk step, is still referenced at the lanes' join."""
    model = Transformer(files.get, files.args, Numerics.named("native"))
    lanes = _WhereLanes()
    state = model.new_state()
    model.forward(torch.tensor(PROMPT), state, files.experts, last_only=True)
    runner = DecodeRunner(model, files.experts, whole=True, lanes=lanes)
    inputs = _LaneInputs(lanes)
    with inputs:
        runner.step(state, torch.tensor([5]))
        runner.chunk(state, [7, 8, 9])
    assert len(inputs.ops) > 10  # the lanes' work ran under the check
    assert lanes.freed_early == []


def test_decode_step_equals_forward_native(files):
    _, _, _, pairs = _pair(files, "native", 70)
    # same kernels and order: native quantisation sees the same inputs, so results agree bitwise
    # unless a reduction over a different number of masked slots rounds differently
    assert max(_rel(a, b) for a, b in pairs) <= 1e-4
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in pairs)


def test_layered_mode_streams_through_a_small_cache(packed):
    rec = open_model(packed)
    record = rec.experts.store.record_bytes
    k, units = rec.args.n_activated_experts, len(rec.experts.store.layers())
    rec.close()
    files = open_model(packed, cache_bytes=(k + 2) * record)  # far below the pool: evictions
    try:
        model = Transformer(files.get, files.args, Numerics.named("exact"))
        runner = make_runner(model, files.experts, torch.device("cpu"), enabled=True)
        assert runner is None  # no graphs on the CPU: the engine keeps its eager path
        ref_files = open_model(packed)
        ref_model = Transformer(ref_files.get, ref_files.args, Numerics.named("exact"))
        ref_state, state = ref_model.new_state(), model.new_state()
        ref_model.forward(torch.tensor(PROMPT), ref_state, ref_files.experts)
        model.forward(torch.tensor(PROMPT), state, files.experts)
        runner = DecodeRunner(model, files.experts, whole=False)
        before = files.experts.stats()
        tok = 5
        for _ in range(6):
            a = ref_model.forward(torch.tensor([tok]), ref_state, ref_files.experts, last_only=True)
            b = runner.step(state, tok)
            assert _rel(a, b) <= 1e-5
            tok = int(a.argmax())
        after = files.experts.stats()
        lookups = (after.hits + after.misses) - (before.hits + before.misses)
        assert 6 * (units - 1) <= lookups <= 6 * (units - 1) * k  # distinct experts per main layer
        assert after.misses > before.misses and after.evictions > before.evictions
        assert files.experts.cache.pinned() == files.experts.cache.held() == frozenset()  # every hold released
        ref_files.close()
    finally:
        files.close()


def test_layered_mode_needs_room_for_one_layers_experts(packed):
    rec = open_model(packed)
    record, k = rec.experts.store.record_bytes, rec.args.n_activated_experts
    rec.close()
    files = open_model(packed, cache_bytes=(k - 1) * record)
    try:
        model = Transformer(files.get, files.args, Numerics.named("exact"))
        state = model.new_state()
        model.forward(torch.tensor(PROMPT), state, files.experts)
        runner = DecodeRunner(model, files.experts, whole=False)
        with pytest.raises(CacheFullError, match="larger budget"):
            for tok in range(20):  # some layer routes the token to k distinct experts
                runner.step(state, tok)
        assert files.experts.cache.pinned() == files.experts.cache.held() == frozenset()
    finally:
        files.close()


def test_whole_mode_counts_every_use_as_a_hit(files):
    model = Transformer(files.get, files.args, Numerics.named("native"))
    state = model.new_state()
    model.forward(torch.tensor(PROMPT), state, files.experts)
    before = files.experts.stats()
    runner = DecodeRunner(model, files.experts, whole=True)
    for tok in (3, 4, 5):
        runner.step(state, tok)
    runner.settle()  # the last step's routes
    after = files.experts.stats()
    assert after.misses == before.misses
    main_layers = files.args.n_layers
    assert 3 * main_layers <= after.hits - before.hits <= 3 * main_layers * files.args.n_activated_experts


def test_whole_mode_survives_a_flush(packed):
    """/flush evicts experts the one-graph step would read: the runner goes layered (loading what
    it needs) and returns to one graph per step once the pool is resident again."""
    files = open_model(packed)
    ref_files = open_model(packed)
    try:
        assert files.experts.load_all()
        model = Transformer(files.get, files.args, Numerics.named("exact"))
        ref_model = Transformer(ref_files.get, ref_files.args, Numerics.named("exact"))
        state, ref_state = model.new_state(), ref_model.new_state()
        model.forward(torch.tensor(PROMPT), state, files.experts)
        ref_model.forward(torch.tensor(PROMPT), ref_state, ref_files.experts)
        runner = DecodeRunner(model, files.experts, whole=True)
        for i, tok in enumerate((3, 4, 5)):
            if i == 1:
                runner.settle()  # as Engine.flush_cache does: the last step's experts were resident
                files.experts.flush()
            want = ref_model.forward(torch.tensor([tok]), ref_state, ref_files.experts, last_only=True)
            assert _rel(want, runner.step(state, tok)) <= 1e-5
            assert runner.whole == (i == 0)
        assert files.experts.load_all() and files.experts.all_resident()
        want = ref_model.forward(torch.tensor([6]), ref_state, ref_files.experts, last_only=True)
        assert _rel(want, runner.step(state, 6)) <= 1e-5 and runner.whole
    finally:
        files.close()
        ref_files.close()


def test_load_all_reports_progress(packed):
    files = open_model(packed)
    try:
        seen = []
        assert files.experts.load_all(lambda done, total: seen.append((done, total)))
        units = files.args.n_layers  # the main layers: the MTP block's experts are never routed
        assert units < len(files.experts.store.layers())  # the pack holds the MTP block's too
        assert seen == [(i, units) for i in range(units + 1)] and files.experts.all_resident()
    finally:
        files.close()


def test_load_all_refuses_a_budget_below_the_pool(packed):
    rec = open_model(packed)
    record = rec.experts.store.record_bytes
    rec.close()
    files = open_model(packed, cache_bytes=10 * record)
    try:
        assert files.experts.load_all() is False
        assert files.experts.stats().misses == 0  # nothing was read
    finally:
        files.close()


class _Spy:
    """Records the runner's provider calls, passing them on."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.arena = inner.arena

    def fence(self):
        return self.inner.fence()

    def resident(self, layer, ids):
        return self.inner.resident(layer, ids)

    def acquire(self, layer, ids):
        self.calls.append(("acquire", layer, sorted(set(ids))))
        self.inner.acquire(layer, ids)

    def release(self, layer):
        self.inner.release(layer)

    def prefetch(self, layer, ids, fence=None):
        self.calls.append(("prefetch", layer, sorted(set(ids))))
        self.inner.prefetch(layer, ids, fence)

    def record(self, layer, ids):
        self.inner.record(layer, ids)

    def all_resident(self):
        return self.inner.all_resident()


class _NeverResident:
    """A provider that never says a layer's experts are resident: every layered step acquires
    before its segment (the order before resident layers' bookkeeping moved after the launch)."""

    def __init__(self, inner):
        self.inner, self.arena, self.resident_calls = inner, inner.arena, 0

    def resident(self, layer, ids):
        self.resident_calls += 1
        return False

    def __getattr__(self, name):  # every other call goes to the real provider
        return getattr(self.inner, name)


class _Counting:
    """Counts the layers the real provider finds resident."""

    def __init__(self, inner):
        self.inner, self.arena, self.answers = inner, inner.arena, []

    def resident(self, layer, ids):
        self.answers.append(self.inner.resident(layer, ids))
        return self.answers[-1]

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("lookahead", [False, True])
def test_resident_layers_acquired_after_their_segment_leave_the_cache_as_before(packed, lookahead):
    """Layered steps through a cache that holds some layers' experts and misses others: a layer
    whose experts are all resident launches its segment before `acquire` does the bookkeeping;
    the logits, the cache's statistics, contents, order and usage counts are those of acquiring
    every layer first."""
    rec = open_model(packed)
    record, k = rec.experts.store.record_bytes, rec.args.n_activated_experts
    pool = rec.args.n_layers * rec.experts.store.count  # the main layers' experts (not the MTP block's)
    rec.close()
    runs = []
    for wrap in (_NeverResident, _Counting):
        files = open_model(packed, cache_bytes=(pool - k) * record)  # most layers resident, some misses
        try:
            model = Transformer(files.get, files.args, Numerics.named("exact"), lookahead=lookahead)
            state = model.new_state()
            model.forward(torch.tensor(PROMPT), state, files.experts)
            provider = wrap(files.experts)
            runner = DecodeRunner(model, provider, whole=False)
            tok, logits = 5, []
            for _ in range(8):
                out = runner.step(state, tok)
                logits.append(out)
                tok = int(out.argmax())
            cache = files.experts.cache
            usage = files.experts.usage
            # the resident keys, not their slots: which slot a prefill's miss takes follows the order
            # its reads complete in, which differs from run to run
            runs.append((provider, logits, files.experts.stats(), set(cache.resident()), cache.hottest(10 ** 6),
                         dict(usage.uses), list(usage.layer_uses)))
            assert cache.pinned() == cache.held() == frozenset()
        finally:
            files.close()
    (never, *before), (counting, *after) = runs
    assert never.resident_calls > 0 and True in counting.answers and False in counting.answers  # both paths
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert before[1:] == after[1:]


def test_layered_mode_reads_hash_layer_experts_ahead(packed):
    rec = open_model(packed)
    record, k = rec.experts.store.record_bytes, rec.args.n_activated_experts
    rec.close()
    files = open_model(packed, cache_bytes=4 * k * record)
    try:
        args = files.args
        hashed = [i for i in range(args.n_layers) if args.is_hash_layer(i)]
        assert hashed  # the tiny model has hash layers
        model = Transformer(files.get, args, Numerics.named("native"))
        state = model.new_state()
        model.forward(torch.tensor(PROMPT), state, files.experts)
        spy = _Spy(files.experts)
        runner = DecodeRunner(model, spy, whole=False)
        tok = 321
        runner.step(state, tok)
        first_acquire = next(i for i, c in enumerate(spy.calls) if c[0] == "acquire")
        prefetched = {c[1]: c[2] for c in spy.calls[:first_acquire] if c[0] == "prefetch"}
        assert set(prefetched) == set(hashed)  # every hash layer, before any layer runs its experts
        for layer in hashed:
            assert prefetched[layer] == sorted(set(model.blocks[layer].ffn.gate.tid2eid_host[tok].tolist()))
            acquired = next(c[2] for c in spy.calls if c[0] == "acquire" and c[1] == layer)
            assert acquired == prefetched[layer]
    finally:
        files.close()


def test_runtime_replays_through_the_runner_with_stats_and_trace(files, tmp_path):
    """The engine's Runtime with a runner (the GPU path, here run eagerly on the CPU): same
    logits as the eager Runtime, steps flagged as graphed, usage counted by the provider (the
    same counts as the eager steps: once per use, whichever path) and the routing trace fed
    from the runner's routes."""
    import threading

    from engine.experts.trace import RoutingTrace, TraceWriter, read_records
    from engine.runtime import Runtime

    args = files.args
    model = Transformer(files.get, args, Numerics.named("native"))
    experts = files.experts
    with TraceWriter(tmp_path / "t.jsonl") as writer:
        trace = RoutingTrace(writer)

        def routes(layer, position, ids):
            trace("experts", layer, position, torch.tensor([ids]))

        runner = DecodeRunner(model, experts, whole=True, on_routes=routes)
        lock = threading.RLock()
        graphed = Runtime(model, experts, torch.device("cpu"), lock, trace, runner)
        plain = Runtime(model, experts, torch.device("cpu"), lock)
        s1, s2 = model.new_state(), model.new_state()
        u0 = list(experts.usage.layer_uses)
        plain_out = [plain.step(s1, PROMPT)] + [plain.step(s1, [tok]) for tok in (5, 6, 7)]
        u1 = list(experts.usage.layer_uses)
        b = graphed.step(s2, PROMPT)  # prefill: eager, and a graphed chunk step
        a = plain_out[0]
        assert b.graphed and torch.equal(a.logits, b.logits)
        for a, tok in zip(plain_out[1:], (5, 6, 7)):
            b = graphed.step(s2, [tok])
            assert b.graphed and b.tokens == 1 and _rel(a.logits, b.logits) <= 1e-4
            # a replayed step is not split into attention and MoE: its time is the graph's
            assert b.timing.graph_ms > 0 and b.timing.attention_ms == b.timing.moe_ms == 0
            assert a.timing.graph_ms == 0 and a.timing.moe_ms > 0
        assert s1.pos == s2.pos == len(PROMPT) + 3
        graphed.settle()  # the last replayed step's routes (the engine settles when a turn ends)
    u2 = list(experts.usage.layer_uses)
    eager_uses = [y - x for x, y in zip(u0, u1)]
    graph_uses = [y - x for x, y in zip(u1, u2)]
    assert sum(graph_uses) > 0 and all(graph_uses)
    assert graph_uses == eager_uses  # the same routes counted the same, once each
    recs = list(read_records(tmp_path / "t.jsonl"))
    decode = [r for r in recs if r.tokens == 1]
    assert len(decode) == (len(PROMPT) + 3) * args.n_layers  # one record per layer and token
    assert [r.layer for r in decode[:args.n_layers]] == list(range(args.n_layers))


def test_arena_cells_equal_the_per_expert_loop(files):
    """A prefill chunk's MoE through one fp4_moe call over every (token, choice) cell (the
    resident-arena path, taken on the CPU arena as on CUDA) equals the per-expert loop: cells grouped by expert
    and put back in (token, choice) order, each token's row its own; both count each used expert once."""
    model = Transformer(files.get, files.args, Numerics.named("native"))
    moe = next(b.ffn for b in model.blocks if not b.ffn.gate.hash)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, files.args.dim, generator=gen).to(torch.bfloat16)
    ids = torch.arange(11)
    idx, w = moe.route(x, ids)
    uses = files.experts.usage.layer_uses[moe.layer]
    looped = moe._expert_loop(x, idx, w, files.experts)  # the per-expert loop
    celled = moe(x, ids, files.experts, (idx, w))
    assert moe._batched(files.experts) and files.experts.all_resident()  # what __call__ takes here, on the CPU as on CUDA
    assert celled.shape == looped.shape and celled.dtype == looped.dtype
    assert torch.equal(celled, looped)  # the reference computes each row on its own either way
    used = len(set(idx.flatten().tolist()))
    assert files.experts.usage.layer_uses[moe.layer] == uses + 2 * used


def test_a_long_chunk_on_a_resident_arena_takes_the_sync_free_groups_and_counts_its_uses(files):
    """Enough cells per expert, every expert resident: one group of every expert from the
    device counts (`Cells.all_groups`, no host sync on CUDA), its uses counted by `record_later`
    (at once on the CPU); the result equals the per-expert loop."""
    from engine.moe import Cells

    model = Transformer(files.get, files.args, Numerics.named("native"))
    moe = next(b.ffn for b in model.blocks if not b.ffn.gate.hash)
    n = 16 * files.experts.n_experts  # 16 cells per expert at least
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, files.args.dim, generator=gen).to(torch.bfloat16)
    ids = torch.arange(n)
    idx, w = moe.route(x, ids)
    cells = Cells(idx, files.experts.n_experts)
    assert cells.one_group and cells.all_groups(torch.zeros(cells.experts, dtype=torch.int32))
    uses = files.experts.usage.layer_uses[moe.layer]
    assert torch.equal(moe(x, ids, files.experts, (idx, w)), moe._expert_loop(x, idx, w, files.experts))
    used = len(set(idx.flatten().tolist()))
    assert files.experts.usage.layer_uses[moe.layer] == uses + 2 * used


def test_whole_steps_count_their_routes_after_the_next_launch(files):
    """A whole-mode step leaves its routes pending: the next step counts them after its own
    launch (so on the GPU that host work overlaps it), or settle() does; positions and experts
    are those of the step that made them, and settling twice counts once."""
    model = Transformer(files.get, files.args, Numerics.named("native"))
    n = files.args.n_layers
    seen, eager_seen = [], []
    runs = []
    for out in (seen, eager_seen):
        state = model.new_state()
        model.forward(torch.tensor(PROMPT), state, files.experts)
        runs.append((DecodeRunner(model, files.experts, whole=True,
                                  on_routes=lambda layer, pos, ids, out=out: out.append((layer, pos, tuple(ids)))),
                     state))
    (runner, state), (settled, state2) = runs
    p0 = state.pos
    before = files.experts.stats().hits
    runner.step(state, 5)
    assert seen == [] and files.experts.stats().hits == before  # pending: nothing counted yet
    runner.step(state, 6)
    assert [(layer, pos) for layer, pos, _ in seen] == [(layer, p0) for layer in range(n)]
    runner.settle()
    runner.settle()
    assert [(layer, pos) for layer, pos, _ in seen] == [(layer, p) for p in (p0, p0 + 1) for layer in range(n)]
    for tok in (5, 6):  # the same steps, settled right after each: the same routes
        settled.step(state2, tok)
        settled.settle()
    assert eager_seen == seen
    assert all(len(set(ids)) == files.args.n_activated_experts for _, _, ids in seen)


class _CountingHeads(DecodeRunner):
    """A runner that counts the steps that ran the head."""

    heads = 0

    def _head(self, out):
        self.heads += 1
        super()._head(out)

    def _chunk_head(self, out):
        self.heads += 1
        super()._chunk_head(out)


def test_a_short_prefill_runs_the_head_once_and_a_step_without_logits_leaves_the_same_state(files):
    """A short prefill (here a graphed chunk step; replayed tokens skip the head but the last)
    runs the head once; a step without logits returns None and leaves the state as a step with
    them does."""
    import threading

    from engine.runtime import Runtime

    model = Transformer(files.get, files.args, Numerics.named("native"))
    runner = _CountingHeads(model, files.experts, whole=True)
    runtime = Runtime(model, files.experts, torch.device("cpu"), threading.RLock(), None, runner)
    state = model.new_state()
    (result,) = runtime.prefill(state, PROMPT[:8], 16)  # one chunk of 8
    assert runner.heads == 1 and result.graphed and result.logits.shape == (files.args.vocab_size,)
    a, b = state.clone(), state.clone()
    assert runner.step(a, 5, logits=False) is None and runner.heads == 1
    runner.step(b, 5)
    assert a.pos == b.pos
    for x, y in zip(a.layers, b.layers):
        assert all(torch.equal(t, u) for t, u in zip(x.tensors(), y.tensors()))
    assert torch.equal(runner.step(a, 7), runner.step(b, 7))


def test_short_prefill_chunks_replay_the_decode_step(packed):
    """With a runner, Runtime.prefill runs a chunk of at most SHORT_PREFILL tokens as decode
    steps (one result for the chunk, flagged graphed) and a longer chunk eagerly at a bounded
    cache (layered); at a full arena (whole) a prompt of at most GRAPHED_PREFILL tokens runs in
    graphed chunk steps of CHUNK_SLOTS tokens instead, whatever the chunk size. The logits and
    the next step equal the eager chunked prefill's."""
    import threading

    from engine.runtime import SHORT_PREFILL, Runtime

    prompt = PROMPT + [9, 31, 64, 2, 128, 7, 44, 19, 3, 250, 6]  # 24 tokens: one chunk of 24, or 16 + 8
    probe = open_model(packed)
    record, k = probe.experts.store.record_bytes, probe.args.n_activated_experts
    probe.close()
    for slots in (None, 2 * k):  # every expert in the arena (whole), or a bounded cache (layered)
        files = open_model(packed, cache_bytes=None if slots is None else slots * record)
        try:
            whole = files.experts.load_all() if slots is None else False
            model = Transformer(files.get, files.args, Numerics.named("native"))
            lock = threading.RLock()
            runner = DecodeRunner(model, files.experts, whole=whole)
            graphed = Runtime(model, files.experts, torch.device("cpu"), lock, None, runner)
            plain = Runtime(model, files.experts, torch.device("cpu"), lock)
            for chunk in (16, 8):  # 24 tokens: chunks 16 + 8 (both short), or 8 + 8 + 8
                s1, s2 = model.new_state(), model.new_state()
                eager = list(plain.prefill(s1, prompt, chunk))
                replayed = list(graphed.prefill(s2, prompt, chunk))
                assert [r.tokens for r in replayed] == ([16, 8] if whole else [r.tokens for r in eager])
                assert all(r.graphed for r in replayed) and all(r.tokens <= SHORT_PREFILL for r in replayed)
                assert s1.pos == s2.pos == len(prompt)
                assert _rel(eager[-1].logits, replayed[-1].logits) <= 1e-4
                graphed.settle()
                a, b = plain.step(s1, [5]), graphed.step(s2, [5])
                assert _rel(a.logits, b.logits) <= 1e-4
                graphed.settle()
            long = list(graphed.prefill(model.new_state(), prompt, 2048))  # one chunk of 24: eager when layered
            assert [(r.tokens, r.graphed) for r in long] == ([(16, True), (8, True)] if whole else [(24, False)])
        finally:
            files.close()


def test_prefill_calls_on_queued_after_its_last_chunk_is_launched_and_before_it_is_waited_for(files):
    """`Runtime.prefill(on_queued=)`: once, when the last chunk is queued and not yet waited for,
    a graphed chunk step (one launch) or eager (chunks 16 + 8); what it copies is the state after
    the prompt (the turn's regenerate snapshot is taken there)."""
    import threading

    from engine.runtime import Runtime

    class _Log(Runtime):
        def __init__(self, *args, order: list):
            super().__init__(*args)
            self.order = order

        def launch(self, state, ids, logits=True):
            self.order.append("launch")
            return super().launch(state, ids, logits)

        def finish(self, launched):
            self.order.append("finish")
            return super().finish(launched)

    model = Transformer(files.get, files.args, Numerics.named("native"))
    runner = DecodeRunner(model, files.experts, whole=True)
    prompt = PROMPT + [9, 31, 64, 2, 128, 7, 44, 19, 3, 250, 6]  # 24 tokens
    for runner_, ids, chunk, want in ((runner, PROMPT[:8], 16, ["launch", "queued", "finish"]),  # a chunk step
                                      (None, prompt, 16, ["launch", "finish", "launch", "queued", "finish"])):
        log: list = []
        runtime = _Log(model, files.experts, torch.device("cpu"), threading.RLock(), None, runner_, order=log)
        state, copies = model.new_state(), []

        def queued():
            log.append("queued")
            copies.append(state.clone())

        results = list(runtime.prefill(state, ids, chunk, on_queued=queued))
        assert log == want and len(copies) == 1 and sum(r.tokens for r in results) == len(ids)
        assert copies[0].pos == state.pos == len(ids)
        for x, y in zip(copies[0].layers, state.layers):
            assert all(torch.equal(t, u) for t, u in zip(x.tensors(), y.tensors()))
        runtime.settle()

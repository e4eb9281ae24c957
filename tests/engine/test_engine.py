"""Engine facade on the tiny synthetic model (vocab 129280, real tokenizer): multi-turn KV reuse
equals re-prefilling from scratch, regenerate, undo, cancel, thinking-mode rewind, context limit,
statistics against the expert cache's own counters, memory budget."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from converter import synth
from engine.buckets import chunk_lengths
from engine.chat import ChatTokenizer, Message, render_messages
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import ContextOverflow, EngineFailure, StepUpdate, TextDelta, TurnFinished
from engine.experts.cache import ExpertCache
from engine.experts.resident import ResidentExperts
from engine.model import Transformer
from engine.numerics import Numerics
from engine.sampling import SamplingParams
from engine.state import MIN_ENTRIES
from engine.session import SessionError
from engine.weights import open_official
from kernels.backend import OP_NAMES

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
USER_TEXTS = [
    "Explain in a few words why the sky looks blue during the day and red in the evening.",
    "Now tell me something about mixture of experts models and how routing works.",
    "What is the capital of France, and which river flows through it?",
    "Write one sentence about streaming weights from an NVMe disk into a small cache.",
    "Thanks! Summarise our whole conversation so far in two short sentences please.",
    "One more: count from one to ten in French, separated by commas.",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    return synth.write_checkpoint(out, synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = Engine.load(ckpt, EngineConfig(numerics="exact", prefill_chunk=32))
    yield eng
    eng.close()


def turn(events) -> tuple[TurnFinished | EngineFailure, list]:
    evs = list(events)
    return evs[-1], evs


def scratch(eng: Engine, prompt: list[int], n_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Last-position logits of prefilling `prompt` from position 0, and n greedy tokens after it."""
    model, experts = eng.model, eng.files.experts
    state = model.new_state()
    with torch.inference_mode():
        logits = model.forward(torch.tensor(prompt), state, experts, last_only=True)[0]
        first, tokens = logits, []
        for _ in range(n_tokens):
            tokens.append(int(torch.argmax(logits)))
            if len(tokens) < n_tokens:
                logits = model.forward(torch.tensor(tokens[-1:]), state, experts, last_only=True)[0]
    return first, tokens


def check_against_scratch(eng: Engine, sess, fin: TurnFinished) -> None:
    """The turn's prompt state (kept snapshot) and greedy tokens equal a from-scratch run."""
    s = fin.stats
    prompt, completion = sess.ids[:s.prompt_tokens], sess.ids[s.prompt_tokens:]
    assert len(completion) == s.completion_tokens
    snap = [x for x in sess.snapshots if x.logits is not None and len(x.ids) == s.prompt_tokens][-1]
    assert snap.ids == prompt
    first, tokens = scratch(eng, prompt, len(completion))
    assert tokens == completion
    torch.testing.assert_close(snap.logits, first, rtol=1e-5, atol=1e-5)


def test_kv_reuse_equals_scratch_over_six_turns(engine):
    tok = engine.tokenizer
    sess = engine.new_session(system="You are a terse assistant.")
    for i, text in enumerate(USER_TEXTS):
        before, position, text_before = sess.ids, sess.position, sess.live.text
        fin, evs = turn(engine.generate(sess, text, GREEDY))
        assert isinstance(fin, TurnFinished), fin
        s = fin.stats
        assert s.reused_tokens == position  # everything processed before is kept...
        assert sess.ids[:len(before)] == before  # ...and the old ids (completions too) are a prefix
        assert s.prefill_tokens == s.prompt_tokens - s.reused_tokens
        prompt_text = render_messages(sess.conversation(sess.messages[:-1]), thinking=False)
        assert tok.decode(sess.ids[:s.prompt_tokens]) == prompt_text
        # only the pending last token and the new text were run
        assert s.prefill_tokens == len(before) - position + len(tok.encode(prompt_text[len(text_before):]))
        assert sess.messages[-2] == Message("user", text)
        assert sess.messages[-1].content == fin.content
        assert "".join(e.text for e in evs if isinstance(e, TextDelta)) in fin.content
        check_against_scratch(engine, sess, fin)
    assert sess.position > 128 + 16  # crossed the window (16) and both compression ratios (4, 128)
    assert len(sess.messages) == 2 * len(USER_TEXTS)


def test_regenerate_gives_the_same_greedy_answer_without_prefill(engine):
    sess = engine.new_session()
    first, _ = turn(engine.generate(sess, USER_TEXTS[0], GREEDY))
    ids, messages = sess.ids, list(sess.messages)
    again, _ = turn(engine.regenerate(sess, GREEDY))
    assert isinstance(again, TurnFinished)
    assert again.content == first.content and sess.ids == ids and sess.messages == messages
    assert again.stats.prefill_tokens == 0 and again.stats.reused_tokens == first.stats.prompt_tokens
    with pytest.raises(SessionError):
        engine.regenerate(engine.new_session(), GREEDY)


def test_undo_rewinds_to_the_previous_turn(engine):
    sess = engine.new_session(system="Be brief.")
    turn(engine.generate(sess, USER_TEXTS[0], GREEDY))
    ids, position, messages = sess.ids, sess.position, list(sess.messages)
    second, _ = turn(engine.generate(sess, USER_TEXTS[1], GREEDY))
    engine.undo(sess)
    assert sess.messages == messages and sess.ids == ids and sess.position == position
    assert sess.state.pos == position
    redo, _ = turn(engine.generate(sess, USER_TEXTS[1], GREEDY))
    assert redo.content == second.content
    assert redo.stats.prefill_tokens == second.stats.prefill_tokens
    engine.undo(sess)
    engine.undo(sess)
    assert sess.messages == [] and sess.position == 0
    with pytest.raises(SessionError):
        engine.undo(sess)


def test_a_turn_copies_the_live_state_for_the_next_turns_undo_point(engine):
    """A finished turn leaves a copy of the live state (counted by nbytes); the next turn keeps
    that copy as its undo point instead of copying on its first token's path; a copy of a live
    state that changed since is not handed out."""
    sess = engine.new_session()
    turn(engine.generate(sess, USER_TEXTS[0], GREEDY))
    spare_of, spare = sess._spare
    assert spare_of is sess.live and spare.state is not sess.live.state and spare.ids == sess.live.ids
    assert sess.nbytes() == sess.live.nbytes() + spare.nbytes() + sum(x.nbytes() for x in sess.snapshots)
    assert all(torch.equal(a, b) for x, y in zip(spare.state.layers, sess.live.state.layers)
               for a, b in zip(x.tensors(), y.tensors()))
    turn(engine.generate(sess, USER_TEXTS[1], GREEDY))
    assert any(x is spare for x in sess.snapshots)  # the undo point is the copy made between turns
    engine.undo(sess)
    assert sess.live.ids == spare.ids and sess.state.pos == spare.state.pos
    sess.spare_live()
    kept = sess._spare[1]
    sess.live = sess.live.copy()  # the live snapshot changed (as a rolled-back turn replaces it)
    fresh = sess.live_copy()
    assert fresh is not kept and fresh.ids == kept.ids and sess._spare is None


def test_cancel_mid_generation_keeps_a_consistent_session(engine):
    sess = engine.new_session()
    cancel = threading.Event()
    decode_steps = 0
    evs = []
    for ev in engine.generate(sess, USER_TEXTS[2], SamplingParams(temperature=0.0, max_tokens=50), cancel):
        evs.append(ev)
        if isinstance(ev, StepUpdate) and ev.stats.ttft_s is not None:
            decode_steps += 1
            if decode_steps == 2:
                cancel.set()
    fin = evs[-1]
    assert isinstance(fin, TurnFinished) and fin.stats.finish_reason == "cancelled"
    # a step's update comes once the token after it is read and launched: three sampled tokens,
    # all run, kept with their ids
    assert fin.stats.completion_tokens == 3
    assert sess.position == len(sess.ids) == fin.stats.prompt_tokens + 3
    assert sess.messages[-1] == Message("assistant", fin.content)
    check_against_scratch(engine, sess, fin)
    nxt, _ = turn(engine.generate(sess, USER_TEXTS[3], GREEDY))
    assert nxt.stats.reused_tokens == fin.stats.prompt_tokens + 3
    check_against_scratch(engine, sess, nxt)


def test_each_token_is_launched_before_the_host_reads_it(engine, monkeypatch):
    """The next step runs on the sampled token (a device tensor) before the host reads it; the
    token that reaches max_tokens is not run: it waits in `pending` for the next turn."""
    rt, order = engine.runtime, []
    launch, read = rt.launch, rt.read

    def spy_launch(state, ids, **options):
        if isinstance(ids, torch.Tensor):  # prefill chunks come as host lists
            order.append("launch")
        return launch(state, ids, **options)

    def spy_read(token):
        value = read(token)

        def get():
            order.append("read")
            return value()
        return get

    monkeypatch.setattr(rt, "launch", spy_launch)
    monkeypatch.setattr(rt, "read", spy_read)
    sess = engine.new_session()
    fin, _ = turn(engine.generate(sess, USER_TEXTS[3], GREEDY))
    assert fin.stats.finish_reason == "max_tokens" and fin.stats.completion_tokens == GREEDY.max_tokens
    assert order == ["launch", "read"] * (GREEDY.max_tokens - 1) + ["read"]
    assert sess.live.pending == [sess.ids[-1]] and sess.position == len(sess.ids) - 1
    check_against_scratch(engine, sess, fin)


def test_the_next_step_is_launched_before_the_host_waits_for_the_last(engine, monkeypatch):
    """The decode loop never leaves the device idle for the host: step k+1 is queued (on the
    token sampled from step k's logits, themselves not yet waited for) before step k is finished."""
    rt, order, alive = engine.runtime, [], []  # alive: no id() is reused while the turn runs
    launch, finish = rt.launch, rt.finish

    def spy_launch(state, ids, **options):
        launched = launch(state, ids, **options)
        alive.append(launched)
        if isinstance(ids, torch.Tensor):  # decode steps: the sampled token stays a tensor
            order.append(("launch", id(launched)))
        return launched

    def spy_finish(launched):
        order.append(("finish", id(launched)))
        return finish(launched)

    monkeypatch.setattr(rt, "launch", spy_launch)
    monkeypatch.setattr(rt, "finish", spy_finish)
    sess = engine.new_session()
    fin, _ = turn(engine.generate(sess, USER_TEXTS[3], GREEDY))
    steps = [i for kind, i in order if kind == "launch"]
    assert len(steps) == GREEDY.max_tokens - 1
    decode = [ev for ev in order if ev[1] in steps]  # prefill's launch+finish pairs left out
    assert decode[:2] == [("launch", steps[0]), ("launch", steps[1])]
    for k in range(len(steps) - 1):  # step k is finished after step k+1 was launched
        assert decode.index(("finish", steps[k])) > decode.index(("launch", steps[k + 1]))
    check_against_scratch(engine, sess, fin)


def test_a_turn_grows_the_state_before_its_first_decode_step(engine, monkeypatch):
    """Decode graphs are captured on the state's buffers: a turn reserves room for all its tokens
    first, so its decode steps all see the same buffers, even across a capacity boundary."""
    rt, buffers = engine.runtime, []
    launch = rt.launch

    def spy_launch(state, ids, **options):
        if isinstance(ids, torch.Tensor):  # decode steps
            buffers.append(tuple((st.capacity, st.kv.data_ptr()) for st in state.layers if st.compressor))
        return launch(state, ids, **options)

    monkeypatch.setattr(rt, "launch", spy_launch)
    sess = engine.new_session()
    fin, _ = turn(engine.generate(sess, USER_TEXTS[0], SamplingParams(temperature=0.0, max_tokens=80)))
    start = fin.stats.prompt_tokens
    assert start < 4 * MIN_ENTRIES < start + 80  # the turn may cross the ratio-4 layer's first capacity
    assert len(buffers) == fin.stats.completion_tokens - (fin.stats.finish_reason == "max_tokens") > 1
    assert len(set(buffers)) == 1
    assert min(cap for cap, _ in buffers[0]) >= (start + 80) // 128 + 1  # room for the turn's last token
    assert max(cap for cap, _ in buffers[0]) >= (start + 80) // 4 + 1 > MIN_ENTRIES


def test_an_eos_is_run_with_its_turn_and_the_next_turn_starts_after_it(ckpt, engine):
    sess = engine.new_session()
    fin, _ = turn(engine.generate(sess, USER_TEXTS[0], GREEDY))
    first = sess.ids[fin.stats.prompt_tokens]  # the greedy first token of the answer
    prompt_logits = [x for x in sess.snapshots if x.logits is not None and len(x.ids) == fin.stats.prompt_tokens]
    assert prompt_logits[-1].logits[first] > 0
    files, tok = open_official(ckpt), ChatTokenizer.from_dir(ckpt)
    head = files.get("head.weight").clone()
    head[tok.eos_id] = 2 * head[first]  # EOS now outscores the token greedy picked first
    model = Transformer(lambda n: head if n == "head.weight" else files.get(n), files.args, Numerics.named("exact"))
    eng = Engine(files, model, tok, EngineConfig(numerics="exact", prefill_chunk=32))
    try:
        s2 = eng.new_session()
        fin, _ = turn(eng.generate(s2, USER_TEXTS[0], GREEDY))
        assert fin.stats.finish_reason == "eos" and fin.stats.completion_tokens == 1 and fin.stats.step_ms == ()
        assert s2.ids[-1] == tok.eos_id and s2.live.pending == []  # the EOS was run with the turn
        assert s2.position == len(s2.ids) == fin.stats.prompt_tokens + 1
        nxt, _ = turn(eng.generate(s2, USER_TEXTS[1], GREEDY))
        assert isinstance(nxt, TurnFinished), nxt
        assert nxt.stats.reused_tokens == fin.stats.prompt_tokens + 1  # nothing of the first turn runs again
        check_against_scratch(eng, s2, nxt)
    finally:
        eng.close()


def test_cancel_during_prefill_rolls_the_state_back(engine):
    sess = engine.new_session()
    turn(engine.generate(sess, USER_TEXTS[0], GREEDY))
    ids, position = sess.ids, sess.position
    cancel = threading.Event()
    cancel.set()
    fin, _ = turn(engine.generate(sess, USER_TEXTS[1], GREEDY, cancel))
    assert fin.stats.finish_reason == "cancelled" and fin.stats.completion_tokens == 0
    assert sess.ids == ids and sess.position == position == sess.state.pos
    assert sess.messages[-2:] == [Message("user", USER_TEXTS[1]), Message("assistant", "")]
    nxt, _ = turn(engine.generate(sess, USER_TEXTS[2], GREEDY))
    assert nxt.stats.reused_tokens == position
    check_against_scratch(engine, sess, nxt)


def test_thinking_mode_rewinds_before_the_dropped_reasoning(engine):
    tok = engine.tokenizer
    think = SamplingParams(temperature=0.0, max_tokens=5, thinking=True)
    sess = engine.new_session(system="Think first.")
    first, evs = turn(engine.generate(sess, USER_TEXTS[0], think))
    p1 = first.stats.prompt_tokens
    ids1 = sess.ids
    assert ids1[p1 - 1] == tok.think_start_id
    assert {e.channel for e in evs if isinstance(e, TextDelta)} <= {"thinking", "answer"}
    reasoning = sess.messages[-1].reasoning
    second, _ = turn(engine.generate(sess, USER_TEXTS[1], think))
    s = second.stats
    # the previous reasoning is dropped from the prompt: resume right before turn 1's <think>
    assert s.reused_tokens == p1 - 1 and sess.ids[:p1 - 1] == ids1[:p1 - 1]
    assert sess.ids[p1 - 1] == tok.think_end_id
    prompt_text = render_messages(sess.conversation(sess.messages[:-1]), thinking=True)
    assert reasoning and reasoning not in prompt_text
    assert tok.decode(sess.ids[:s.prompt_tokens]) == prompt_text
    check_against_scratch(engine, sess, second)


def test_context_limit_fails_cleanly_and_the_session_stays_usable(ckpt):
    eng = Engine.load(ckpt, EngineConfig(numerics="exact", max_seq_len=48), warmup=False)
    try:
        sess = eng.new_session()
        ok, _ = turn(eng.generate(sess, "Hi", GREEDY))
        assert isinstance(ok, TurnFinished)
        ids, messages = sess.ids, list(sess.messages)
        fail, evs = turn(eng.generate(sess, " ".join(["word"] * 60), GREEDY))
        assert isinstance(fail, ContextOverflow) and len(evs) == 1  # an EngineFailure, with its numbers
        assert "context limit of 48 tokens" in fail.message and fail.limit == 48
        assert fail.prompt_tokens == len(eng.tokenizer.encode(render_messages(
            sess.conversation(messages + [Message("user", " ".join(["word"] * 60))]), False)))
        assert sess.ids == ids and sess.messages == messages
        # a front end's check before it queues a turn (the HTTP server's) is the turn's own rule
        long = sess.conversation(messages + [Message("user", " ".join(["word"] * 60))])
        assert eng.context_overflow(long) == fail
        assert eng.context_overflow(sess.conversation(messages + [Message("user", "Go on")])) is None
        full, _ = turn(eng.generate(sess, "Go on", SamplingParams(temperature=0.0, max_tokens=100)))
        assert full.stats.finish_reason == "context" and len(sess.ids) == 48
        check_against_scratch(eng, sess, full)
    finally:
        eng.close()


class CachedExperts(ResidentExperts):
    """Test provider: experts from the checkpoint, but every use goes through an ExpertCache."""

    def __init__(self, inner: ResidentExperts, cache: ExpertCache) -> None:
        super().__init__(inner.fetch, inner.n_layers, inner.n_experts, inner.top_k)
        self.cache = cache

    def _experts(self, layer, ids):
        for e in ids:
            if self.cache.lookup((layer, e)) is None:
                self.cache.admit((layer, e))
            yield from super()._experts(layer, [e])


def test_stats_equal_the_cache_counters_and_tok_per_s_comes_from_step_times(ckpt):
    files = open_official(ckpt)
    entry = files.args.expert_record_bytes()
    cache = ExpertCache(24 * entry, entry, num_layers=files.args.n_layers, num_experts=files.args.n_routed_experts)
    files.experts = CachedExperts(files.experts, cache)
    model = Transformer(files.get, files.args, Numerics.named("exact"))
    eng = Engine(files, model, ChatTokenizer.from_dir(ckpt), EngineConfig(numerics="exact"))
    try:
        sess = eng.new_session()
        t0 = time.perf_counter()
        fin, evs = turn(eng.generate(sess, USER_TEXTS[1], GREEDY))
        wall = time.perf_counter() - t0
        c, cs = eng.stats().cache, cache.stats()
        assert (c.hits, c.misses, c.evictions, c.bytes_read) == (cs.hits, cs.misses, cs.evictions, cs.bytes_read)
        assert (c.entries, c.capacity_entries, c.used_bytes, c.pinned) == (cs.entries, 24, cs.used_bytes, cs.pinned)
        assert c.capacity_bytes == 24 * entry and c.hit_rate == cs.hit_rate
        assert c.hit_rate_window == cs.hit_rate_window and c.per_layer_hit_rate == cs.per_layer_hit_rate
        assert cs.misses > 0 and cs.evictions > 0 and fin.stats.cache.misses == cs.misses
        # throughput from the measured steps
        steps = fin.stats.step_ms
        assert len(steps) == GREEDY.max_tokens - 1 and all(ms > 0 for ms in steps)
        assert fin.stats.tok_per_s == pytest.approx(len(steps) / (sum(steps) / 1e3))
        assert eng.stats().tok_per_s == pytest.approx(fin.stats.tok_per_s)
        assert fin.stats.decode_s + fin.stats.prefill_s <= wall
        timing = [e.stats.timing for e in evs if isinstance(e, StepUpdate)][-1]
        assert timing.moe_ms > 0 and timing.total_ms > 0
        # cache control goes to the same cache
        eng.pin([(3, 1)])
        assert (3, 1) in cache.pinned()
        hot = eng.pin_hot(2)
        assert hot == cache.hottest(2) and set(hot) <= cache.pinned()
        contents = eng.cache_contents()
        assert [(l, e) for l, e, _, _ in contents] == sorted(cache.resident())
        assert all(p == ((l, e) in cache.pinned()) for l, e, p, _ in contents)
        resident_pinned = sum(1 for k in cache.pinned() if k in cache.resident())
        assert eng.flush_cache() == len(contents) - resident_pinned
        assert len(cache) == resident_pinned
        eng.unpin(None)
        assert not cache.pinned()
    finally:
        eng.close()


def test_resident_experts_stats_and_memory_budget(engine):
    sess = engine.new_session()
    turn(engine.generate(sess, USER_TEXTS[0], GREEDY))
    st = engine.stats()
    assert st.cache.hits == sum(engine.experts.usage.uses.values()) > 0 and st.cache.hit_rate == 1.0
    assert st.cache.misses == 0 and st.cache.entries == 5 * 16
    mem = engine.memory()
    assert sum(size for _, size in mem.parts) == mem.total and all(size >= 0 for _, size in mem.parts)
    assert mem.unified and mem.parts[-1][0] == "free"
    # counted at load: the bytes of every tensor the model read (all but the routed experts and,
    # without MTP, the mtp block), as stored in the checkpoint
    index = engine.files.index
    read = [n for n in index.names() if ".ffn.experts." not in n and not n.startswith("mtp.")]
    assert mem.part("resident weights") == engine.model.weight_bytes == sum(index.info(n).nbytes for n in read) > 0
    assert mem.part("session state") >= sess.nbytes() > 0


def test_engine_info_routing_trace_and_closed_engine(ckpt, tmp_path):
    from engine.experts.trace import read_records

    trace = tmp_path / "trace.jsonl"
    eng = Engine.load(ckpt, EngineConfig(numerics="exact", trace_path=str(trace)), warmup=False)
    info = eng.info
    # an unmarked synthetic checkpoint is not the demo (engine/demo_marker.py; tests/engine/test_demo_marker.py)
    assert (info["n_layers"], info["n_experts"], info["demo"], info["numerics"]) == (5, 16, False, "exact")
    assert info["backend"] == "torch" and info["reference_ops"] == list(OP_NAMES)  # the reference serves every op
    sess = eng.new_session()
    fin, _ = turn(eng.generate(sess, "Hi", GREEDY))
    eng.close()
    records = list(read_records(trace))
    prefill = len(chunk_lengths(fin.stats.prompt_tokens, eng.config.prefill_chunk))  # bucketed chunks
    steps = prefill + fin.stats.completion_tokens - 1  # the prefill, then one step per run token
    assert len(records) == steps * 5 and sum(r.tokens for r in records if r.layer == 0) == sess.position
    eng.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(sess, "hi", GREEDY)


def test_streaming_layout_small_cache_same_answers_and_counters(ckpt, engine, tmp_path):
    from converter.convert import convert

    out = convert(ckpt, tmp_path / "converted", resume=False)
    entry = -(-engine.args.expert_record_bytes() // 4096) * 4096  # records are padded to 4 KiB
    eng = Engine.load(out, EngineConfig(numerics="exact", cache_bytes=24 * entry), warmup=False)
    try:
        cache = eng.files.experts.cache
        assert eng.info["experts"] == "streaming" and cache.capacity_slots == 24
        resident, streamed = engine.new_session(), eng.new_session()
        for text in USER_TEXTS[:2]:
            a, _ = turn(engine.generate(resident, text, GREEDY))
            b, _ = turn(eng.generate(streamed, text, GREEDY))
            assert b.content == a.content and streamed.ids == resident.ids  # bounded cache == resident
        c, cs = eng.stats().cache, cache.stats()
        assert (c.hits, c.misses, c.evictions, c.bytes_read, c.entries) == \
            (cs.hits, cs.misses, cs.evictions, cs.bytes_read, cs.entries)
        assert cs.misses > 0 and cs.evictions > 0 and c.capacity_entries == 24
        assert eng.stats().read_bytes_per_s >= 0
        assert eng.flush_cache() == cs.entries and len(cache) == 0
    finally:
        eng.close()


def test_history_and_system_prompt(engine):
    history = [Message("user", "Hi"), Message("assistant", "Hello! How can I help?")]
    sess = engine.new_session(system="Be kind.", history=history)
    assert sess.position == 0 and sess.messages == history
    fin, _ = turn(engine.generate(sess, "Tell me a joke", GREEDY))
    assert fin.stats.reused_tokens == 0
    prompt = render_messages([Message("system", "Be kind.")] + history + [Message("user", "Tell me a joke")], False)
    assert engine.tokenizer.decode(sess.ids[:fin.stats.prompt_tokens]) == prompt
    sess.set_system("Be terse.")  # with turns taken: a new conversation
    assert sess.messages == [] and sess.position == 0 and sess.system == "Be terse."
    with pytest.raises(SessionError, match="system="):
        engine.new_session(history=[Message("system", "x")])


def test_two_turns_of_one_session_cannot_interleave(engine):
    """A session answers one turn at a time: a second turn started while the first runs fails at
    once and leaves the first, and the session, as if it had not been asked."""
    sess = engine.new_session()
    first = engine.generate(sess, USER_TEXTS[0], GREEDY)
    next(first)  # the first turn is running
    second_end, _ = turn(engine.generate(sess, USER_TEXTS[1], GREEDY))
    assert isinstance(second_end, EngineFailure) and "already answering" in second_end.message
    assert "close()" in second_end.message  # says how to end a turn stopped early
    fin, _ = turn(first)
    assert isinstance(fin, TurnFinished)
    assert [m.content for m in sess.messages if m.role == "user"] == [USER_TEXTS[0]]
    check_against_scratch(engine, sess, fin)
    fin, _ = turn(engine.generate(sess, USER_TEXTS[1], GREEDY))  # once it has ended, the next one runs
    assert isinstance(fin, TurnFinished)
    check_against_scratch(engine, sess, fin)


def test_a_turn_has_ended_when_its_last_event_is_taken(engine):
    """A caller that stops at the last event (TurnFinished or EngineFailure) and keeps the
    generator, never asking for more, does not keep the session busy: its next turn runs."""
    sess = engine.new_session()
    first = engine.generate(sess, USER_TEXTS[0], GREEDY)
    fin = next(ev for ev in first if isinstance(ev, TurnFinished))
    assert not sess.answering
    nxt = engine.generate(sess, USER_TEXTS[1], GREEDY)
    end = next(ev for ev in nxt if isinstance(ev, (TurnFinished, EngineFailure)))  # kept too
    assert isinstance(end, TurnFinished) and end.stats.reused_tokens > fin.stats.prompt_tokens
    check_against_scratch(engine, sess, end)
    regen = engine.regenerate(sess, GREEDY)
    assert isinstance(next(ev for ev in regen if isinstance(ev, TurnFinished)), TurnFinished)
    assert not sess.answering
    failed = engine.generate(sess, "x " * engine.config.max_seq_len, GREEDY)  # over the context limit
    assert isinstance(next(failed), EngineFailure) and not sess.answering


@pytest.mark.parametrize("events_taken", [1, 4])  # in the prefill; in the decode loop
def test_a_turn_closed_mid_way_leaves_the_session_as_before(engine, events_taken):
    """close() on a turn stopped early ends it: the session is as before the turn (messages, ids,
    state) and its next turn runs, reusing what came before."""
    sess = engine.new_session()
    turn(engine.generate(sess, USER_TEXTS[0], GREEDY))
    messages, ids, position = list(sess.messages), sess.ids, sess.position
    first = engine.generate(sess, USER_TEXTS[1], SamplingParams(temperature=0.0, max_tokens=20))
    taken = [next(first) for _ in range(events_taken)]
    assert sess.answering and not any(isinstance(ev, (TurnFinished, EngineFailure)) for ev in taken)
    assert (sum(isinstance(ev, TextDelta) for ev in taken) > 0) == (events_taken > 1)
    first.close()
    assert not sess.answering
    assert sess.messages == messages and sess.ids == ids and sess.position == position == sess.state.pos
    nxt, _ = turn(engine.generate(sess, USER_TEXTS[2], GREEDY))
    assert isinstance(nxt, TurnFinished) and nxt.stats.reused_tokens == position
    check_against_scratch(engine, sess, nxt)


def test_turns_made_together_answer_after_each_other(engine):
    """A turn takes the conversation as it is when it starts: two made before either runs, then run
    one after the other, keep both questions and answers."""
    sess = engine.new_session()
    one, two = engine.generate(sess, USER_TEXTS[0], GREEDY), engine.generate(sess, USER_TEXTS[1], GREEDY)
    assert isinstance(turn(one)[0], TurnFinished)
    fin, _ = turn(two)
    assert isinstance(fin, TurnFinished)
    assert [m.content for m in sess.messages if m.role == "user"] == USER_TEXTS[:2]
    check_against_scratch(engine, sess, fin)


def test_a_regenerate_made_before_an_undo_fails_when_nothing_is_left(engine):
    sess = engine.new_session()
    assert isinstance(turn(engine.generate(sess, USER_TEXTS[0], GREEDY))[0], TurnFinished)
    again = engine.regenerate(sess, GREEDY)
    engine.undo(sess)
    end, _ = turn(again)
    assert isinstance(end, EngineFailure) and "nothing to regenerate" in end.message
    assert sess.messages == []

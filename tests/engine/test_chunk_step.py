"""The graphed chunk step (`DecodeRunner.chunk`: up to CHUNK_SLOTS tokens in one static step,
engine/chunk_position.py) against `Transformer.forward` on the CPU, where it runs eagerly: the
same logits and state bit for bit in native numerics across chunk lengths, window wrap-around,
compressed-entry emission (ratios 4 and 128) and capacity growth; `Runtime.prefill` runs a short
prompt in such steps; without every expert resident, or in exact numerics, none runs. (Its
CUDA graph is exercised by tests/engine/test_decode_graph_gpu.py.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.chunk_position import CHUNK_SLOTS, ChunkPosition
from engine.decode_graph import DecodeRunner
from engine.model import Transformer
from engine.numerics import Numerics
from engine.runtime import GRAPHED_PREFILL, Runtime
from engine.weights import open_model
from oracle import assert_same_live_state


def _tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunk_steps_equal_forward_bit_for_bit(files):
    args = files.args
    model = Transformer(files.get, args, Numerics.named("native"))
    runner = DecodeRunner(model, files.experts, whole=True)
    assert runner.can_chunk()
    ref, state = model.new_state(), model.new_state()
    # lengths 1..16 from every phase of the ratio-4 windows, across ratio-128 boundaries
    # (positions 128 and 256) and the window's wrap-around; 1 token: the decode step
    lengths = [5, 16, 3, 1, 16, 7, 16, 16, 13, 2, 16, 16, 16, 9, 16, 16, 16, 16, 11, 16, 16, 4, 16, 16, 16]
    toks = _tokens(sum(lengths), args.vocab_size)
    pos = 0
    for n in lengths:
        ids = toks[pos:pos + n]
        pos += n
        a = model.forward(torch.tensor(ids), ref, files.experts, last_only=True)
        b = runner.chunk(state, ids) if n > 1 else runner.step(state, ids[0])
        assert torch.equal(a, b), (pos, n)
    assert pos > 2 * 128 and any(s.capacity > 16 for s in state.layers)  # two ratio-128 windows; grown
    assert_same_live_state(ref, state, args)
    assert not any(t.isnan().any() for layer in state.layers for t in layer.tensors())  # nor in an entry left open
    # a step without logits leaves the same state
    a, b = state.clone(), state.clone()
    assert runner.chunk(a, toks[:6], logits=False) is None
    runner.chunk(b, toks[:6])
    assert all(torch.equal(t, u) for x, y in zip(a.layers, b.layers) for t, u in zip(x.tensors(), y.tensors()))


def test_chunk_step_routes_are_counted_as_an_eager_chunks(files):
    """Its routes are counted when it is settled: each layer's distinct experts over the real
    tokens once (as the eager chunk of the same tokens counts them), each real token's route to
    `on_routes`, the padded slots' never."""
    args = files.args
    model = Transformer(files.get, args, Numerics.named("native"))
    seen = {}
    runner = DecodeRunner(model, files.experts, whole=True,
                          on_routes=lambda layer, p, ids: seen.setdefault((layer, p), ids))
    ids = _tokens(5, args.vocab_size)
    u0 = list(files.experts.usage.layer_uses)
    model.forward(torch.tensor(ids), model.new_state(), files.experts)
    files.experts.settle_records()
    u1 = list(files.experts.usage.layer_uses)
    runner.chunk(model.new_state(), ids)
    runner.settle()
    u2 = list(files.experts.usage.layer_uses)
    assert sorted(seen) == sorted((layer, p) for layer in range(args.n_layers) for p in range(5))
    counted = [b - a for a, b in zip(u1, u2)]
    assert counted == [b - a for a, b in zip(u0, u1)]
    assert counted == [len({e for p in range(5) for e in seen[layer, p]}) for layer in range(args.n_layers)]


def test_a_chunk_steps_routes_wait_for_the_second_decode_step(files):
    """The decode step launched after a chunk step (the one whose token the host reads first)
    leaves the chunk's routes pending; the next decode step counts them and the first step's,
    in order; a chunk step after a chunk counts the earlier one at once."""
    args = files.args
    model = Transformer(files.get, args, Numerics.named("native"))
    seen = []
    runner = DecodeRunner(model, files.experts, whole=True, on_routes=lambda layer, p, ids: seen.append(p))
    state = model.new_state()
    runner.chunk(state, _tokens(5, args.vocab_size))
    runner.chunk(state, _tokens(3, args.vocab_size, seed=1))
    assert sorted(set(seen)) == list(range(5))  # the first chunk: counted when the second launched
    runner.step(state, 7)
    assert sorted(set(seen)) == list(range(5))  # the second chunk's still pending
    runner.step(state, 8)
    assert sorted(set(seen)) == list(range(9))  # ... counted now, with the first decode step's
    runner.settle()
    assert sorted(set(seen)) == list(range(10)) and len(seen) == 10 * args.n_layers


def test_chunk_position_indexes_the_ring_the_new_keys_and_the_windows():
    at = ChunkPosition(window=8, ratios=(0, 4, 128), size=4, device="cpu")
    at.set(10, [7, 8, 9])  # positions 10, 11, 12 and one padded slot
    assert at.ids.tolist() == [7, 8, 9, 9] and at.pos.tolist() == [10, 11, 12, 13] and at.last.tolist() == [2]
    # K = [4 new keys | ring of 8 | entries]: position q < 10 at ring row 4 + q % 8, q >= 10 at q - 10
    assert at.window_rows[0].tolist() == [4 + q % 8 for q in range(3, 10)] + [0]
    assert at.window_rows[2].tolist() == [4 + q % 8 for q in range(5, 10)] + [0, 1, 2]
    assert at.ring_src.tolist() == [4, 5, 0, 1, 2, 9, 10, 11]  # rows 2, 3, 4 take positions 10..12
    assert at.entry_offset == 12
    # ratio 4: positions 8, 9 open (rows 0, 1 of KV); the chunk completes window 2 (8..11) and
    # leaves 12 open; window 2's previous window is window 1, kept in the compressor (PV rows 0..3)
    assert at.win_src[4].tolist() == [[0, 1, 4, 5]] and at.prev_src[4].tolist() == [[0, 1, 2, 3]]
    assert at.entry[4].tolist() == [2]
    assert at.buf_src[4].tolist() == [6, 1, 2, 3] and at.prev_next[4].tolist() == [4, 5, 8, 9]
    assert at.visible[4].tolist() == [2, 3, 3, 3] and at.ape_row[4].tolist() == [2, 3, 0, 1]
    assert at.entry[128].tolist() == [0] and at.buf_src[128].tolist()[10:13] == [128, 129, 130]
    at.set(8, [1])  # no window completes: the unused slot writes the open entry 2
    assert at.entry[4].tolist() == [2] and at.buf_src[4].tolist() == [4, 1, 2, 3]  # position 8: row 0
    assert at.win_src[4].tolist() == [[4, 5, 6, 7]]  # pooled from the chunk's rows, finite
    assert at.prev_next[4].tolist() == [0, 1, 2, 3]
    at.set(5, [1, 2, 3, 4])  # completes window 1 (positions 4..7: open row 0, then the chunk's 5..7)
    assert at.entry[4].tolist() == [1] and at.win_src[4].tolist() == [[0, 4, 5, 6]]
    with pytest.raises(ValueError, match="1..4 tokens"):
        at.set(0, [1, 2, 3, 4, 5])


def test_runtime_prefills_a_short_prompt_in_chunk_steps(files):
    """`Runtime.prefill` with a runner whose chunk steps run: a prompt of at most GRAPHED_PREFILL
    tokens as chunk steps of CHUNK_SLOTS tokens (flagged graphed; a last single token as a decode
    step), equal to the eager prefill; a longer one in eager chunks."""
    args = files.args
    model = Transformer(files.get, args, Numerics.named("native"))
    lock = threading.RLock()
    graphed = Runtime(model, files.experts, torch.device("cpu"), lock, None, DecodeRunner(model, files.experts, True))
    plain = Runtime(model, files.experts, torch.device("cpu"), lock)
    assert graphed.chunk_tokens() == CHUNK_SLOTS and plain.chunk_tokens() == 0
    prompt = _tokens(GRAPHED_PREFILL + 8, args.vocab_size, seed=1)
    for n, want in ((GRAPHED_PREFILL, [CHUNK_SLOTS] * (GRAPHED_PREFILL // CHUNK_SLOTS)), (CHUNK_SLOTS + 1, [16, 1]),
                    (9, [9]), (GRAPHED_PREFILL + 8, [GRAPHED_PREFILL + 8])):
        s1, s2 = model.new_state(), model.new_state()
        eager = list(plain.prefill(s1, prompt[:n], 64))
        got = list(graphed.prefill(s2, prompt[:n], 64))
        assert [r.tokens for r in got] == want
        assert all(r.graphed for r in got) == (n <= GRAPHED_PREFILL)
        assert s1.pos == s2.pos == n and torch.equal(eager[-1].logits, got[-1].logits)
        graphed.settle()


def test_no_chunk_step_without_every_expert_resident_or_in_exact_numerics(packed, files):
    model = Transformer(files.get, files.args, Numerics.named("exact"))
    assert not DecodeRunner(model, files.experts, whole=True).can_chunk()
    probe = open_model(packed)
    record, k = probe.experts.store.record_bytes, probe.args.n_activated_experts
    probe.close()
    bounded = open_model(packed, cache_bytes=2 * k * record)
    try:
        model = Transformer(bounded.get, bounded.args, Numerics.named("native"))
        runner = DecodeRunner(model, bounded.experts, whole=False)
        assert not runner.can_chunk()
        with pytest.raises(RuntimeError, match="every expert resident"):
            runner.chunk(model.new_state(), [1, 2])
    finally:
        bounded.close()


def test_a_flush_while_a_chunk_waits_for_the_lock_sends_it_down_the_eager_path(files):
    """`Runtime.launch` decides on a chunk step (every expert resident) under the engine's lock:
    a flush by another thread that holds the lock first makes the waiting chunk run eagerly
    (equal to the eager prefill), not fail in `DecodeRunner.chunk` for want of the experts."""
    args = files.args
    model = Transformer(files.get, args, Numerics.named("native"))
    lock = threading.RLock()
    graphed = Runtime(model, files.experts, torch.device("cpu"), lock, None, DecodeRunner(model, files.experts, True))
    plain = Runtime(model, files.experts, torch.device("cpu"), lock)
    prompt = _tokens(CHUNK_SLOTS, args.vocab_size, seed=2)
    want = plain.step(model.new_state(), prompt)
    assert graphed.chunk_tokens() == CHUNK_SLOTS
    state, out = model.new_state(), []
    with lock:  # another thread's flush holds the lock
        launcher = threading.Thread(target=lambda: out.append(graphed.step(state, prompt)), name="chunk-launch")
        launcher.start()
        time.sleep(0.3)  # the launch waits for the lock
        graphed.settle()
        files.experts.flush()
    launcher.join(30)
    assert out and not out[0].graphed  # eager: the flushed pool reads its experts again
    assert state.pos == CHUNK_SLOTS and torch.equal(out[0].logits, want.logits)

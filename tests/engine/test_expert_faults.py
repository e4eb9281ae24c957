"""Faults on the expert path (issue 30): a store that returns EIO, short reads, end of file or
corrupt bytes on chosen records; records zeroed in place; a layer file truncated under a live
engine. Each case: one clear error naming the file, layer and expert; the cache stays
consistent (nothing held, the slot table matches the cache); the conversation is kept."""

from __future__ import annotations

import errno
import json
import os
import shutil

import numpy as np
import pytest
import torch

from converter import synth
from engine import pack as layout
from converter.convert import convert
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import EngineFailure, TurnFinished
from engine.experts.arena import ExpertArena
from engine.experts.cache import ExpertCache
from engine.experts.io_pool import IOPool
from engine.experts.store import ExpertChecksumError, ExpertReadError, ExpertStore
from engine.experts.streaming import StreamingExperts
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    ckpt = synth.write_checkpoint(root / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    return ckpt, convert(ckpt, root / "pack", resume=False)


@pytest.fixture
def pack(tiny, tmp_path):
    """A private copy of the converted model (tests damage it)."""
    return shutil.copytree(tiny[1], tmp_path / "pack")


class FaultyStore(ExpertStore):
    """An ExpertStore whose reads of chosen records fail: faults[(layer, expert)] is "eio"
    (every attempt), "eio-once", "short" (at most 1000 bytes per read), "eof" or "corrupt" (one
    byte flipped after the read). `attempts` counts reads per record."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.faults: dict[tuple[int, int], str] = {}
        self.attempts: dict[tuple[int, int], int] = {}

    def _key(self, fd: int, offset: int) -> tuple[int, int]:
        layer = next(u for u, f in self._fds.items() if f == fd)
        return layer, (offset - self._where[layer][1]) // self.record_bytes

    def _pread(self, fd, out, offset):
        key = self._key(fd, offset)
        self.attempts[key] = self.attempts.get(key, 0) + 1
        fault = self.faults.get(key)
        if fault == "eio" or (fault == "eio-once" and self.attempts[key] == 1):
            raise OSError(errno.EIO, "Input/output error")
        if fault == "eof":
            return 0
        if fault == "short":
            return super()._pread(fd, out[:1000], offset)
        n = super()._pread(fd, out, offset)
        if fault == "corrupt":
            out[0] ^= 0xFF
        return n


def _provider(path, slots: int) -> tuple[StreamingExperts, FaultyStore]:
    m = layout.read_manifest(path)
    cache = ExpertCache(slots * m.record.record_bytes, m.record.record_bytes,
                        num_layers=len(m.units), num_experts=m.count)
    arena = ExpertArena(slots, m.record, len(m.units), m.count)
    store = FaultyStore(path, m)
    return StreamingExperts(store, arena, cache, IOPool(2).start(), top_k=4), store


def _consistent(p: StreamingExperts) -> None:
    """Nothing held or loading; the arena's slot table is exactly the cache's key -> slot map."""
    assert p.cache.pinned() == p.pinned() == p.cache.held() == frozenset() and not p._loads
    table = {(int(l), int(e)): int(p.arena.table[l, e]) for l, e in (p.arena.table >= 0).nonzero().tolist()}
    assert table == p.cache.resident()


def _bytes(path, layer, expert) -> bytes:
    m = layout.read_manifest(path)
    store = ExpertStore(path, m)
    buf = bytearray(store.record_bytes)
    store.read_into(layer, expert, memoryview(buf))
    store.close()
    return bytes(buf)


def test_eio_short_reads_eof_and_corrupt_records(pack):
    p, store = _provider(pack, slots=6)
    try:
        list(p.experts(1, [0, 1]))  # two good records resident
        store.faults = {(1, 2): "eio", (1, 3): "eio-once", (1, 4): "short", (1, 5): "eof", (1, 6): "corrupt"}
        with pytest.raises(ExpertReadError, match=r"expert 2 of layer 1 from .*layer_01\.safetensors.*"
                                                  r"Input/output error.*dsv4-convert --verify"):
            list(p.experts(1, [0, 2]))
        assert store.attempts[(1, 2)] == 3  # tried again twice
        _consistent(p)
        assert (1, 0) in p.cache and (1, 2) not in p.cache
        # a transient EIO and short reads are retried: the right bytes arrive
        got = {e: bytes(torch.cat([t.reshape(-1).view(torch.uint8) for t in (
            w.w1, w.w1_scale, w.w3, w.w3_scale, w.w2, w.w2_scale)]).numpy()) for e, w in p.experts(1, [3, 4])}
        assert set(got) == {3, 4} and store.attempts[(1, 4)] > 1
        slot = p.cache.peek((1, 4))
        assert bytes(p.arena.data[slot].numpy()) == _bytes(pack, 1, 4)
        with pytest.raises(ExpertReadError, match=r"layer_01\.safetensors ends before expert 5 of layer 1.*truncated"):
            list(p.experts(1, [5]))
        _consistent(p)
        with pytest.raises(ExpertChecksumError, match=r"expert 6 of layer 1 in .*layer_01\.safetensors does not "
                                                      r"match its checksum.*dsv4-convert --verify"):
            list(p.experts(1, [6]))
        _consistent(p)
        assert (1, 6) not in p.cache
        store.faults = {}  # the disk recovers: the same records load, checked
        assert sorted(e for e, _ in p.experts(1, [2, 5, 6])) == [2, 5, 6]
        _consistent(p)
        # acquire (the graph runner's path) fails the same way and releases what it held
        store.faults = {(2, 7): "corrupt"}
        with pytest.raises(ExpertChecksumError, match="expert 7 of layer 2"):
            p.acquire(2, [1, 7])
        _consistent(p)
    finally:
        p.close()


def test_a_failed_hint_read_does_not_stop_guesses_and_its_key_counts_as_missing(pack):
    """A hint's read that failed, never joined, is no read in flight (`reading`: guessed steps
    go on), but its expert is missing (`first_missing`, so a guess that routes to it is redone),
    the pool is not all resident, and the layer's next use raises the read's error."""
    p, store = _provider(pack, slots=6)
    try:
        list(p.experts(0, [0, 1]))
        store.faults = {(1, 2): "eio"}
        p.prefetch(1, [0, 2])
        p.wait_reads()
        assert not p.reading() and not p.all_resident()
        assert p.first_missing([[0, 1], [0, 2]]) == 1 and p.first_missing(np.array([[0, 1], [0, 2]])) == 1
        assert p.first_missing([[0, 1], [0, 0]]) is None  # (1, 0) landed
        with pytest.raises(ExpertReadError, match="expert 2 of layer 1"):
            p.acquire(1, [0, 2])
        _consistent(p)
    finally:
        p.close()


def test_records_zeroed_in_place_fail_their_checksum(pack):
    m = layout.read_manifest(pack)
    store = ExpertStore(pack, m)
    path, base = store._where[3]
    assert store.checksums
    with open(path, "r+b") as f:  # same size, the bytes of expert 9 zeroed
        f.seek(base + 9 * store.record_bytes)
        f.write(bytes(store.record_bytes))
    buf = memoryview(bytearray(store.record_bytes))
    store.read_into(3, 8, buf)  # its neighbour is fine
    with pytest.raises(ExpertChecksumError, match="expert 9 of layer 3"):
        store.read_into(3, 9, buf)
    store.close()


def test_a_manifest_without_record_checksums_is_read_unchecked(pack):
    doc = json.loads((pack / "manifest.json").read_text())
    for entry in doc["files"].values():
        entry.pop("records", None)
    (pack / "manifest.json").write_text(json.dumps(doc))
    store = ExpertStore(pack, layout.read_manifest(pack))
    assert not store.checksums and "not checked" in store.checksum_note
    buf = memoryview(bytearray(store.record_bytes))
    store.read_into(2, 4, buf)
    assert bytes(buf) == _bytes(pack, 2, 4)
    store.close()


def test_a_layer_file_truncated_under_a_live_engine(tiny, pack):
    """The next turn fails with one clear line (no SIGBUS: the resident tensors were copied and
    records are read with pread); the session keeps its conversation; once the file is back
    the same turn runs."""
    m = layout.read_manifest(pack)
    record = m.record.record_bytes
    eng = Engine.load(pack, EngineConfig(numerics="exact", cache_bytes=8 * record), warmup=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=3)
        sess = eng.new_session()
        assert isinstance(list(eng.generate(sess, "Hello", params))[-1], TurnFinished)
        messages, ids = list(sess.messages), list(sess.ids)
        path, base = eng.experts.store._where[2]
        original = path.read_bytes()
        eng.flush_cache()
        os.truncate(path, base + record)  # only expert 0 of layer 2 is left
        fin = list(eng.generate(sess, "Tell me more about the sea", params))[-1]
        assert isinstance(fin, EngineFailure)
        assert "layer_02.safetensors ends before expert" in fin.message and "of layer 2" in fin.message
        assert "truncated" in fin.message and "\n" not in fin.message
        assert sess.messages == messages and sess.ids == ids  # the conversation is kept
        _consistent(eng.experts)
        path.write_bytes(original)  # repaired in place (the store's descriptor stays valid)
        fin = list(eng.generate(sess, "Tell me more about the sea", params))[-1]
        assert isinstance(fin, TurnFinished) and len(sess.messages) == len(messages) + 2
    finally:
        eng.close()


def test_a_corrupt_record_under_a_live_engine_fails_the_turn_and_keeps_the_session(pack):
    m = layout.read_manifest(pack)
    record = m.record.record_bytes
    eng = Engine.load(pack, EngineConfig(numerics="exact", cache_bytes=8 * record), warmup=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=2)
        sess = eng.new_session()
        path, base = eng.experts.store._where[1]
        original = path.read_bytes()
        damaged = bytearray(original)
        for e in range(m.count):  # one byte of every record of layer 1, file size unchanged
            damaged[base + e * record + 100] ^= 0xFF
        path.write_bytes(bytes(damaged))
        fin = list(eng.generate(sess, "Hello", params))[-1]
        assert isinstance(fin, EngineFailure)
        assert "of layer 1 in" in fin.message and "does not match its checksum" in fin.message
        assert sess.messages == [] and sess.ids == []
        _consistent(eng.experts)
        path.write_bytes(original)
        assert isinstance(list(eng.generate(sess, "Hello", params))[-1], TurnFinished)
        assert [m.role for m in sess.messages] == ["user", "assistant"]
    finally:
        eng.close()

"""Per-sequence state (engine/state.py): compressed-entry capacity growth, clones."""

from __future__ import annotations

import torch

from engine.state import MIN_ENTRIES, SequenceState, new_layer_state


def test_reserve_grows_to_powers_of_two_and_keeps_the_entries():
    st = new_layer_state(window=8, head_dim=4, ratio=4, index_head_dim=2, dtype=torch.float32)
    assert st.capacity == MIN_ENTRIES == 16
    st.kv[8:].copy_(torch.arange(16 * 4, dtype=torch.float32).view(16, 4))
    st.indexer.entries.fill_(3.0)
    kept = st.kv.clone()
    assert not st.reserve(16)  # fits: same buffers
    sizes = []
    for n in (17, 33, 65, 129, 300, 1000, 1100, 5000):
        before = st.kv.data_ptr()
        assert st.reserve(n) and st.kv.data_ptr() != before
        sizes.append(st.capacity)
        assert st.indexer.entries.shape[0] == st.capacity
        assert torch.equal(st.kv[:8 + 16], kept)  # window and old entries copied
        assert st.compressor.entries.data_ptr() == st.kv[8:].data_ptr()  # the entries stay a view
    assert sizes == [32, 64, 128, 256, 512, 1024, 2048, 8192]  # at least double, a power of two
    assert bool((st.indexer.entries[:16] == 3.0).all()) and not st.reserve(8192)


def test_clone_copies_every_buffer_once_and_keeps_the_views():
    layers = [new_layer_state(8, 4, r, 2, torch.float32) for r in (0, 4, 128)]
    state = SequenceState(layers=layers, mtp=new_layer_state(8, 4, 0, 2, torch.float32), pos=37, extra={"k": [1]})
    for i, layer in enumerate(layers + [state.mtp]):
        for j, t in enumerate(layer.tensors()):
            t.copy_(torch.full_like(t, 10 * i + j))
    copy = state.clone()
    assert copy.pos == 37 and copy.extra == {"k": [1]} and copy.extra is not state.extra
    for a, b in zip(layers + [state.mtp], copy.layers + [copy.mtp]):
        assert len(a.tensors()) == len(b.tensors())
        for x, y in zip(a.tensors(), b.tensors()):
            assert torch.equal(x, y) and x.data_ptr() != y.data_ptr()
        if b.compressor is not None:  # the attention entries and the window stay views of kv
            assert b.compressor.entries.data_ptr() == b.kv[b.window_size:].data_ptr()
            assert b.compressor.ratio == a.compressor.ratio
        assert b.window.data_ptr() == b.kv.data_ptr()
    copy.layers[1].kv.fill_(-1.0)
    copy.layers[1].indexer.buf_kv.fill_(-1.0)
    assert float(layers[1].kv[0, 0]) == 10.0 and float(layers[1].indexer.buf_kv[0, 0]) != -1.0
    assert copy.layers[1].reserve(40) and not torch.equal(copy.layers[1].kv[:8], layers[1].kv[:8])

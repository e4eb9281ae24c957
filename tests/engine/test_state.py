"""Per-sequence state (engine/state.py): compressed-entry capacity growth."""

from __future__ import annotations

import torch

from engine.state import MIN_ENTRIES, new_layer_state


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

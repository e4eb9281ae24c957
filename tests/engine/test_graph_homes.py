"""Graph homes (engine/graph_homes.py): states of one capacity take turns in one set of buffers,
each keeping its own values, so that decode graphs captured on those buffers serve them all."""

from __future__ import annotations

import pytest
import torch

from engine.graph_homes import GraphHomes, signature
from engine.state import SequenceState, new_layer_state


def make_state(seed: int, capacity: int = 16) -> SequenceState:
    """Layers of ratio 0, 4 and 128 (window 8, head_dim 16, indexer 8), filled with seeded values."""
    g = torch.Generator().manual_seed(seed)
    layers = [new_layer_state(8, 16, r, 8, torch.float32, capacity=capacity) for r in (0, 4, 128)]
    state = SequenceState(layers=layers, pos=seed)
    for layer in layers:
        for t in layer.tensors():
            t.copy_(torch.randn(t.shape, generator=g))
    return state


def values(state: SequenceState) -> list[torch.Tensor]:
    return [t.clone() for layer in state.layers for t in layer.tensors()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_use_takes_the_buffers_in_tensors_order_and_keeps_the_views():
    a, b = make_state(1), make_state(2)
    for la, lb in zip(a.layers, b.layers):
        la.use(lb.tensors())
        assert all(x is y for x, y in zip(la.tensors(), lb.tensors()))
        if la.compressor is not None:  # the attention entries stay a view of kv
            assert la.compressor.entries.data_ptr() == la.kv[la.window_size:].data_ptr()
    with pytest.raises(ValueError, match="more tensors"):
        a.layers[0].use(a.layers[0].tensors() + [torch.zeros(1)])


def test_the_first_state_of_a_signature_lends_its_buffers_and_reenters_for_free():
    homes, a = GraphHomes(), make_state(1)
    before = [t for layer in a.layers for t in layer.tensors()]
    home = homes.enter(a)
    assert home.held_by(a) and all(x is y for x, y in zip(home.buffers, before))
    home.sets["flow"] = "graphs"
    assert homes.enter(a) is home and homes.moves == 0 and home.sets == {"flow": "graphs"}


def test_states_of_one_capacity_take_turns_in_one_home_and_keep_their_values():
    homes = GraphHomes()
    a, b = make_state(1), make_state(2)
    va, vb = values(a), values(b)
    home = homes.enter(a)
    assert homes.enter(b) is home and homes.moves == 1
    assert home.held_by(b) and not home.held_by(a)  # a got buffers of its own first
    assert same(values(a), va) and same(values(b), vb)
    for t in home.buffers:  # b's step writes into the home's buffers
        t.add_(1.0)
    vb = values(b)
    assert homes.enter(a) is home and home.held_by(a) and homes.moves == 2
    assert same(values(a), va) and same(values(b), vb)  # b moved out with what it wrote
    b_buffers = [t for layer in b.layers for t in layer.tensors()]
    assert all(x.data_ptr() != y.data_ptr() for x, y in zip(b_buffers, home.buffers))  # b has its own now


def test_a_grown_state_gets_a_new_home_and_the_vacant_one_serves_the_next_state():
    homes = GraphHomes()
    a = make_state(1)
    small = homes.enter(a)
    a.layers[1].reserve(40)  # the ratio-4 layer grows: new buffers, a new signature
    big = homes.enter(a)
    assert big is not small and len(homes) == 2 and big.held_by(a) and not small.held_by(a)
    c = make_state(3)
    vc = values(c)
    assert homes.enter(c) is small and small.held_by(c) and same(values(c), vc)
    assert big.held_by(a)  # a was not in the small home any more: left alone


def test_homes_beyond_the_limit_go_least_recently_entered_first_with_their_graph_sets():
    homes = GraphHomes(limit=2)
    states = [make_state(i, capacity=16 << i) for i in range(3)]
    first = homes.enter(states[0])
    first.sets["flow"] = "graphs"
    homes.enter(states[1])
    homes.enter(states[0])  # recently used again
    homes.enter(states[2])  # evicts states[1]'s home
    assert len(homes) == 2 and homes.enter(states[0]) is first and first.sets == {"flow": "graphs"}
    assert signature(states[1]) != signature(states[0])
    homes.clear()
    assert len(homes) == 0 and homes.enter(states[0]) is not first

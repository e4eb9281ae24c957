"""bench/lookahead.py: router lookahead measured on the engine's model (tiny synthetic model)."""

from __future__ import annotations

import pytest
import torch

from bench.lookahead import VARIANTS, Lookahead, observed_forward, report, run_lookahead
from engine.model import Transformer
from engine.numerics import Numerics
from engine.routing_override import ForcedRouting
from engine.weights import open_model

PROMPT = [0, 17, 300, 5, 5, 99, 511, 42, 8, 250, 17, 3, 77]


@pytest.fixture
def files(tiny_ckpt):
    files = open_model(tiny_ckpt)
    yield files
    files.close()


def test_observed_forward_is_the_models_forward(files):
    """Same logits bit for bit and the same routed experts as Transformer.forward, prefill and
    a one-token call; each view holds the block's MoE input and streams."""
    model = Transformer(files.get, files.args, Numerics.named("native"))
    logged = {}

    def log(kind, layer, start, t):
        if kind == "experts":
            logged[layer, start] = t.clone()

    ref_state, state = model.new_state(), model.new_state()
    for ids in (torch.tensor(PROMPT), torch.tensor([321])):
        start = state.pos
        ref = model.forward(ids, ref_state, files.experts, log=log)
        streams, views = observed_forward(model, ids, state, files.experts)
        assert torch.equal(model.logits(streams), ref)
        assert state.pos == ref_state.pos == start + len(ids)
        assert len(views) == files.args.n_layers
        for layer, view in enumerate(views):
            assert torch.equal(view.experts, logged[layer, start])
            assert view.moe_input.shape == (len(ids), files.args.dim)
            assert view.streams.shape == (len(ids), files.args.hc_mult, files.args.dim)


def test_lookahead_counts_shares_of_actual_experts():
    acc = Lookahead(k=4, n_experts=16)
    acc.add(3, "moe_input", torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([[4, 3, 9, 8], [5, 6, 7, 8]]))
    assert acc.accuracy(3, "moe_input") == 6 / 8
    acc.add(4, "moe_input", torch.tensor([[0, 1, 2, 3]]), torch.tensor([[12, 13, 14, 15]]))
    assert acc.accuracy(4, "moe_input") == 0.0 and acc.accuracy(None, "moe_input") == 6 / 12
    assert acc.chance == 0.25 and acc.layers == [3, 4]


def test_run_lookahead_on_the_tiny_model(files):
    """Pairs only for router-routed L+1 (layers 3, 4 of the tiny model); every token's k actual
    experts counted; figures are shares; the report names the chance level."""
    model = Transformer(files.get, files.args, Numerics.named("native"))
    result = run_lookahead(model, files.experts, PROMPT[:6], decode=2)
    k = files.args.n_activated_experts
    assert result.layers == [3, 4]
    for layer in (3, 4):
        for v in VARIANTS:
            assert result.total[layer, v] == k * (6 + 2)
            assert 0.0 <= result.accuracy(layer, v) <= 1.0
    text = report(result, "tiny")
    assert "chance k/E = 4/16 = 25.0%" in text and "| all |" in text


def test_lookahead_needs_the_models_own_routing(files, tmp_path):
    (tmp_path / "t.csv").write_text("pos,layer,n,e0,e1,e2,e3,w0,w1,w2,w3\n0,3,4,1,2,3,4,1,1,1,1\n")
    routing = ForcedRouting.from_csv(tmp_path / "t.csv", files.args, "cpu")
    model = Transformer(files.get, files.args, Numerics.named("native"), routing=routing)
    with pytest.raises(ValueError, match="needs the model's own routing"):
        run_lookahead(model, files.experts, PROMPT[:2], decode=0)

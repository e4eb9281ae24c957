"""CUDA-graph decode on the GPU: graph replays equal the eager step on the same device and backend
(whole graph and per-layer graphs through a small cache), including the re-capture after the
compressed caches grow and after switching to another sequence state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from converter.convert import convert
from engine.decode_graph import DecodeRunner
from engine.model import Transformer
from engine.numerics import Numerics
from engine.weights import open_model
from kernels.backend import make_backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def packed(separated_ckpt, tmp_path_factory) -> Path:
    return convert(separated_ckpt, tmp_path_factory.mktemp("gpack") / "pack")


def _run(packed: Path, backend: str, cache_records: int | None, steps: int, graphs: bool):
    dev = torch.device("cuda")
    probe = open_model(packed)
    record = probe.experts.store.record_bytes
    probe.close()
    files = open_model(packed, cache_bytes=None if cache_records is None else cache_records * record,
                       device="cuda")
    whole = files.experts.load_all()
    model = Transformer(lambda n: files.get(n).to(dev), files.args,
                        Numerics.named("native", make_backend(backend, dev)))
    runner = DecodeRunner(model, files.experts, whole=whole, graphs=graphs)
    out = []
    with torch.inference_mode():
        state = model.new_state()
        tok = model.forward(PROMPT.to(dev), state, files.experts, last_only=True).argmax(-1)
        for i in range(steps):
            if i == steps // 2:  # another sequence state object: the runner must re-capture
                state = state.clone()
            logits = runner.step(state, tok)
            out.append(logits.float().cpu())
            tok = logits.argmax(-1)
    captures = runner.captures
    files.close()
    return torch.cat(out), captures


@pytest.mark.parametrize("backend", ["torch", "tilelang"])
def test_whole_graph_equals_eager(packed, backend):
    eager, _ = _run(packed, backend, None, 100, graphs=False)  # positions 40..139: growth + 128
    graph, captures = _run(packed, backend, None, 100, graphs=True)
    assert captures >= 3  # first step, capacity growth, the cloned state
    assert torch.equal(graph, eager)


def test_layered_graphs_through_a_small_cache_equal_eager(packed):
    eager, _ = _run(packed, "tilelang", None, 24, graphs=False)
    graph, _ = _run(packed, "tilelang", 12, 24, graphs=True)
    assert torch.equal(graph, eager)

"""Helpers to run our model and the transformers oracle on the same checkpoint and collect the
discrete selections (routed experts, indexer picks) of both."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model import Transformer
from engine.numerics import Numerics
from engine.weights import open_official


@dataclass
class Run:
    logits: torch.Tensor  # [S, V] fp32
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [S, k]
    indexer: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [S, topk] (-1 none)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [S, n_entries] (ours only)


def load_ours(path, numerics: str = "exact", with_mtp: bool = False):
    files = open_official(path)
    return Transformer(files.get, files.args, Numerics.named(numerics), with_mtp=with_mtp), files


def run_ours(model: Transformer, files, ids: torch.Tensor, chunks: list[int] | None = None) -> Run:
    """Run ids in the given chunk lengths (default: one prefill); collect selections."""
    chunks = chunks or [len(ids)]
    assert sum(chunks) == len(ids)
    parts: dict[tuple[str, int], list[torch.Tensor]] = {}
    state = model.new_state()
    logits = []

    def log(kind, layer, start, t):
        parts.setdefault((kind, layer), []).append(t.clone())

    pos = 0
    with torch.inference_mode():
        for c in chunks:
            logits.append(model.forward(ids[pos:pos + c], state, files.experts, log=log))
            pos += c
    run = Run(torch.cat(logits))
    for (kind, layer), ts in parts.items():
        if kind == "indexer_scores":  # entry count grows between chunks: pad with -inf
            n = max(t.shape[1] for t in ts)
            ts = [torch.nn.functional.pad(t, (0, n - t.shape[1]), value=float("-inf")) for t in ts]
        getattr(run, {"experts": "experts", "indexer": "indexer", "indexer_scores": "scores"}[kind])[layer] = \
            torch.cat(ts)
    return run


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                device_map="cpu").eval()


def run_hf(hf, ids: torch.Tensor) -> Run:
    """One fp32 prefill through transformers, with forward hooks recording its selections."""
    run = Run(logits=torch.empty(0))
    hooks = []
    for layer, block in enumerate(hf.model.layers):
        def on_router(mod, args, out, layer=layer):
            run.experts[layer] = out[2].view(len(ids), -1).clone()
        hooks.append(block.mlp.gate.register_forward_hook(on_router))
        comp = block.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            def on_indexer(mod, args, out, layer=layer):
                run.indexer[layer] = out[0].clone()
            hooks.append(comp.indexer.register_forward_hook(on_indexer))
    try:
        with torch.no_grad():
            run.logits = hf(ids.unsqueeze(0)).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return run


def as_sets(t: torch.Tensor) -> list[frozenset]:
    """Rows of selection indices as sets, absent (-1) dropped."""
    return [frozenset(i for i in row.tolist() if i >= 0) for row in t]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row relative L2 error of a against reference b."""
    return (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-30)


def assert_same_live_state(ref, state, args) -> None:
    """`state` holds what `ref` holds wherever a later step reads: the window rings, every complete
    compressed entry, the open windows' buffer rows and the previous halves (a chunk step and the
    decode steps of its tokens leave different values in rows no step reads again)."""
    assert state.pos == ref.pos
    for i, (r, s) in enumerate(zip(ref.layers, state.layers)):
        assert torch.equal(s.window, r.window), i
        ratio = args.ratio(i)
        if not ratio:
            continue
        n, rest = divmod(state.pos, ratio)
        for a, b in ((r.compressor, s.compressor), (r.indexer, s.indexer)):
            if a is None:
                continue
            assert torch.equal(b.entries[:n], a.entries[:n]), i  # every complete entry
            assert torch.equal(b.buf_kv[:rest], a.buf_kv[:rest]) and torch.equal(b.buf_gate[:rest], a.buf_gate[:rest])
            if a.prev_kv is not None:
                assert torch.equal(b.prev_kv, a.prev_kv) and torch.equal(b.prev_gate, a.prev_gate), i

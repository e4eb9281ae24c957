"""Router lookahead (issue 27 item 3): how many of layer L+1's routed experts its gate picks
when applied to a hidden state known earlier, at layer L — the prefetch a streaming engine could
start one layer ahead.

    python -m bench.lookahead [--model DIR] [--prompt 64] [--decode 32] [--device cpu]

Without --model it builds the tiny synthetic model (random weights: its figure says nothing
about the real model's, whose consecutive layers share a trained residual stream). With
--model it runs any checkpoint directory the engine opens (official or converted).

What the gate of layer L+1 expects is its MoE input: the mHC mix of the residual streams
(`hc_ffn.pre`) after L+1's attention, RMS-normed with L+1's `ffn_norm`. Two stand-ins known
before it, each normed with L+1's `ffn_norm` and fed to L+1's gate (`Gate`, the engine's own):

* `moe_input`: layer L's MoE input before its norm (layer L's `hc_ffn.pre` output): known when
  layer L routes, so the prefetch overlaps L's experts and L+1's attention (the main figure);
* `streams`: the residual streams after layer L, mixed by L+1's `hc_ffn.pre`: known after L's
  MoE, before L+1's attention (less lead time);
* `bias_only` (a control, no hidden state): the top k of L+1's router bias, the same every token.

Accuracy = share of the actual experts of L+1 (token by token) that the prediction holds; chance
is k / E. Pairs are the layers L+1 >= n_hash_layers (hash layers are known exactly from the token
ids). The pass is the model's own forward, block by block (`observed_forward`; the tests check
it equals `Transformer.forward`), over a prefill and then greedy one-token decode calls.

Then the same calls run through the engine's own router lookahead prefetch (`Transformer` with
`lookahead=True` over a converted pack streamed through a cache of `--cache-share` of the pool;
`engine_lookahead`), and its provider's counters are printed: accuracy (the `moe_input` stand-in,
per call: a decode call counts its k choices, the prefill the union of its tokens'), prefetch
reads issued, used in time or still in flight, unused.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model import Transformer  # noqa: E402
from engine.state import SequenceState  # noqa: E402

VARIANTS = ("moe_input", "streams", "bias_only")


@dataclass
class LayerView:
    """What one block's forward call saw: its MoE input before the norm x [S, D], the residual
    streams after the block [S, n_hc, D], and the experts it routed to [S, k]."""

    moe_input: torch.Tensor
    streams: torch.Tensor
    experts: torch.Tensor


def observed_forward(model: Transformer, ids: torch.Tensor, state: SequenceState, experts) -> tuple[
        torch.Tensor, list[LayerView]]:
    """`Transformer.forward_streams` block by block (same calls, same order) -> final streams
    [S, n_hc, D] and each block's LayerView; advances state.pos by S. Forced routing, if the
    model has one, applies as in the model."""
    start = state.pos
    streams = model.embed_tokens(ids).unsqueeze(1).expand(-1, model.args.hc_mult, -1).contiguous()
    views = []
    at = model.prefill_position(start, ids.shape[0], ids.device)
    for b, st in zip(model.blocks, state.layers):
        x, post, comb = b.hc_attn.pre(streams)
        a = b.attn(b.norm_q(x, b.attn_norm, b.eps), at, st, None)
        streams = b.hc_attn.post(a, streams, post, comb)
        x, post, comb = b.hc_ffn.pre(streams)
        xn = b.norm(x, b.ffn_norm, b.eps)
        forced = None if b.routing is None else b.routing.prefill_ids(b.layer, start, ids.shape[0])
        routed = b.ffn.route(xn, ids, forced)
        streams = b.hc_ffn.post(b.ffn(xn, ids, experts, routed), streams, post, comb)
        views.append(LayerView(x, streams, routed[0]))
    state.pos = start + ids.shape[0]
    return streams, views


@dataclass
class Lookahead:
    """Per layer L+1 and stand-in: predicted-and-actual count and actual count (token choices)."""

    k: int
    n_experts: int
    hit: dict[tuple[int, str], int] = field(default_factory=dict)
    total: dict[tuple[int, str], int] = field(default_factory=dict)

    def add(self, layer: int, variant: str, predicted: torch.Tensor, actual: torch.Tensor) -> None:
        """predicted, actual [S, k] expert ids of `layer` (the L+1 of a pair)."""
        hits = (predicted.unsqueeze(2) == actual.unsqueeze(1)).any(dim=1).sum().item()
        key = (layer, variant)
        self.hit[key] = self.hit.get(key, 0) + int(hits)
        self.total[key] = self.total.get(key, 0) + actual.numel()

    def accuracy(self, layer: int | None, variant: str) -> float:
        """Share of actual experts predicted, for one layer or (None) all layers."""
        keys = [key for key in self.total if key[1] == variant and (layer is None or key[0] == layer)]
        total = sum(self.total[key] for key in keys)
        return sum(self.hit[key] for key in keys) / total if total else float("nan")

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.total})

    @property
    def chance(self) -> float:
        return self.k / self.n_experts


def measure(model: Transformer, views: list[LayerView], ids: torch.Tensor, into: Lookahead) -> None:
    """Apply layer L+1's gate to the stand-ins of layer L (module docstring); count into `into`."""
    for layer in range(1, len(model.blocks)):
        nxt = model.blocks[layer]
        if nxt.ffn.gate.hash:
            continue
        prev = views[layer - 1]
        stand_ins = {"moe_input": prev.moe_input, "streams": nxt.hc_ffn.pre(prev.streams)[0]}
        for variant, x in stand_ins.items():
            predicted = nxt.ffn.gate(nxt.norm(x, nxt.ffn_norm, nxt.eps), ids)[0]
            into.add(layer, variant, predicted, views[layer].experts)
        bias_top = nxt.ffn.gate.bias.topk(into.k).indices  # [k]
        into.add(layer, "bias_only", bias_top.expand(ids.shape[0], -1), views[layer].experts)


def run_lookahead(model: Transformer, experts, prompt: list[int], decode: int) -> Lookahead:
    """Prefill `prompt` in one call, then `decode` greedy one-token calls; the lookahead of every
    call. The model must route with its router (no forced routing)."""
    if model.routing is not None:
        raise ValueError("router lookahead needs the model's own routing: load it without a routing trace")
    a = model.args
    out = Lookahead(a.n_activated_experts, a.n_routed_experts)
    state = model.new_state()
    device = model.embed.device
    ids = torch.tensor(prompt, dtype=torch.long, device=device)
    with torch.inference_mode():
        for _ in range(decode + 1):
            streams, views = observed_forward(model, ids, state, experts)
            measure(model, views, ids, out)
            ids = model.logits(streams[-1:]).argmax(-1)
    return out


def engine_lookahead(pack: Path, prompt: list[int], decode: int, numerics: str, device: str,
                     share: float) -> tuple[dict, dict]:
    """The engine's router lookahead on a converted `pack` streamed through a cache of `share` of
    the pool: prefill `prompt`, then `decode` greedy calls -> (provider.prefetch_stats() after the
    prefill, after the last call)."""
    from engine import pack as layout
    from engine.numerics import Numerics
    from engine.weights import model_footprint, open_model
    from kernels.backend import make_backend

    manifest = layout.read_manifest(pack)
    cache = max(manifest.record.record_bytes * manifest.config.get("num_experts_per_tok", 1),
                int(model_footprint(pack).pool * share))
    files = open_model(pack, cache_bytes=cache, device=device)
    try:
        dev = torch.device(device)
        model = Transformer(lambda name: files.get(name).to(dev), files.args,
                            Numerics.named(numerics, make_backend("torch", dev)), lookahead=True)
        state = model.new_state()
        with torch.inference_mode():
            ids = torch.tensor(prompt, dtype=torch.long, device=dev)
            after_prefill = None
            for _ in range(decode + 1):
                ids = model.forward(ids, state, files.experts, last_only=True).argmax(-1)
                after_prefill = after_prefill or files.experts.prefetch_stats()
        return after_prefill, files.experts.prefetch_stats()
    finally:
        files.close()


def engine_report(first: dict, last: dict, share: float) -> str:
    a, b = first["lookahead"], last["lookahead"]
    routed, predicted = b.routed - a.routed, b.predicted - a.predicted
    lines = [f"engine (Transformer lookahead=True, expert cache {share:.0%} of the pool): decode calls "
             f"{predicted / routed if routed else float('nan'):.1%} ({predicted}/{routed}) of layer L+1's experts predicted"]
    lines += ["  " + s.line() for s in last.values()]
    return "\n".join(lines)


def report(result: Lookahead, label: str) -> str:
    lines = [f"router lookahead on {label}: share of layer L+1's experts predicted by its gate on layer L's "
             f"state (chance k/E = {result.k}/{result.n_experts} = {result.chance:.1%})",
             "", "| layer L+1 | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    for layer in result.layers:
        lines.append(f"| {layer} | " + " | ".join(f"{result.accuracy(layer, v):.1%}" for v in VARIANTS) + " |")
    lines.append("| all | " + " | ".join(f"{result.accuracy(None, v):.1%}" for v in VARIANTS) + " |")
    return "\n".join(lines)


def _tiny_model(workdir: Path) -> Path:
    from converter.synth import SynthOptions, tiny_config, write_checkpoint

    return write_checkpoint(workdir / "ckpt", tiny_config(), SynthOptions(seed=0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a checkpoint directory (default: the tiny synthetic model, random weights)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (drawn at random, seed 0)")
    p.add_argument("--decode", type=int, default=32, help="greedy one-token calls after the prefill")
    p.add_argument("--device", default="cpu")
    p.add_argument("--numerics", default="native", choices=("native", "exact"))
    p.add_argument("--cache-share", type=float, default=0.5,
                   help="the engine run's expert cache as a share of the pool (a converted model)")
    a = p.parse_args(argv)
    from engine.numerics import Numerics
    from engine.weights import open_model
    from kernels.backend import make_backend

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(a.model) if a.model else _tiny_model(Path(tmp))
        device = torch.device(a.device)
        files = open_model(path, device=a.device)
        try:
            if files.experts.arena is not None:
                files.experts.load_all()
            numerics = Numerics.named(a.numerics, make_backend("torch", device))
            model = Transformer(lambda name: files.get(name).to(device), files.args, numerics)
            prompt = torch.randint(0, files.args.vocab_size, (a.prompt,),
                                   generator=torch.Generator().manual_seed(0)).tolist()
            result = run_lookahead(model, files.experts, prompt, a.decode)
        finally:
            files.close()
        label = (f"{path}" if a.model else "the tiny synthetic model (RANDOM weights: not the real model's figure)")
        print(report(result, f"{label}, {a.prompt}-token prefill + {a.decode} decode tokens, {a.numerics}"))
        pack = path if (path / "manifest.json").is_file() else None
        if pack is None and not a.model:
            from converter.convert import convert

            pack = convert(path, Path(tmp) / "pack")
        if pack is None:
            print("\nengine lookahead: not run (an official checkpoint keeps every expert resident; "
                  "give a converted model)")
        else:
            first, last = engine_lookahead(pack, prompt, a.decode, a.numerics, a.device, a.cache_share)
            print()
            print(engine_report(first, last, a.cache_share))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m engine.logits`: logits of one sequence, the contract other tools and checks drive.

    python -m engine.logits --ckpt DIR --ids 0,17,5,... [--numerics exact|native]
                            [--decode-from K] [--cache-gb G] [--device cpu|cuda] --out FILE.safetensors

Runs one sequence — a prefill of all ids, or a prefill of the first K ids followed by one token
at a time — and writes the tensor `logits` [S, vocab] float32 for every position, plus
`experts.L` [S, k] int64 (the routed experts of layer L) for every layer. Keep this stable.
"""

from __future__ import annotations

import argparse
import sys

import torch
from safetensors.torch import save_file

from engine import cli_args
from engine.checkpoint import CheckpointError
from engine.config import ConfigError
from engine.experts.cache import ExpertCacheError
from engine.model import Transformer
from engine.numerics import Numerics
from engine.reproducible import pin_cpu_math
from kernels.backend import make_backend


def run_sequence(model: Transformer, experts, ids: torch.Tensor, decode_from: int | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits [S, V] fp32 for every position and the routed experts per layer {name: [S, k]}."""
    state = model.new_state()
    chosen: dict[int, list[torch.Tensor]] = {}

    def log(kind: str, layer: int, start: int, t: torch.Tensor) -> None:
        if kind == "experts":
            chosen.setdefault(layer, []).append(t.cpu())

    split = len(ids) if decode_from is None else max(1, min(decode_from, len(ids)))
    chunks = [ids[:split]] + [ids[i:i + 1] for i in range(split, len(ids))]
    with torch.inference_mode():
        logits = torch.cat([model.forward(c, state, experts, log=log).float().cpu() for c in chunks])
    return logits, {f"experts.{layer}": torch.cat(v).contiguous() for layer, v in chosen.items()}


def token_ids(text: str) -> list[int]:
    """--ids: comma-separated integers, at least one (argparse type: a bad value exits 2)."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id, got none")
    return ids


def main(argv: list[str] | None = None) -> int:
    pin_cpu_math()  # before any model work (engine/reproducible.py)
    p = cli_args.Parser(prog="python -m engine.logits", description=__doc__.split("\n")[0])
    cli_args.add_engine_args(p, numerics="exact", turns=False)
    p.add_argument("--ids", type=token_ids, required=True, help="comma-separated token ids")
    p.add_argument("--decode-from", type=int, default=None, help="prefill K ids, then decode one at a time")
    p.add_argument("--out", type=cli_args.output_file, required=True,
                   help="output .safetensors file (its folder must exist)")
    a = p.parse_args(argv)
    ids = a.ids
    from engine.loading import plan_memory
    from engine.memory_plan import MemoryPlanError
    from engine.weights import open_model

    try:
        config = cli_args.engine_config_from_args(a)
        plan = plan_memory(a.ckpt, config)
        files = open_model(a.ckpt, cache_bytes=plan.cache)
    except (CheckpointError, ConfigError, ExpertCacheError, MemoryPlanError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        bad = [i for i in ids if not 0 <= i < files.args.vocab_size]
        if bad:
            print(f"error: token ids must be in 0..{files.args.vocab_size - 1}, got {bad[0]}", file=sys.stderr)
            return 2
        ids = torch.tensor(ids, dtype=torch.long)
        device = torch.device(a.device)
        numerics = Numerics.named(config.numerics, make_backend(config.backend, device))
        model = Transformer(lambda name: files.get(name).to(device), files.args, numerics)
        logits, experts = run_sequence(model, files.experts, ids.to(device), a.decode_from)
    finally:
        files.close()
    out = a.out
    tmp = out.with_name(out.name + ".tmp")
    try:
        save_file({"logits": logits, "ids": ids, **experts}, str(tmp))
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(f"error: writing {out}: {exc.strerror or exc}; free space or choose another --out and run "
              "again", file=sys.stderr)
        return 1
    print(f"wrote {out}: logits {tuple(logits.shape)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`dsv4-synth`: the command line of the synthetic checkpoint writer (converter/synth.py).

Exit status 0 written, 1 the output could not be written, 2 bad arguments or configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from converter.stwriter import SafetensorsWriteError
from converter.synth import SynthOptions, write_checkpoint
from converter.synth_config import TOKENIZER_VOCAB, SynthError, chat_tiny_config, flash_config
from engine.checkpoint import INDEX_NAME


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-synth", description=(
        "Write a synthetic DeepSeek-V4-Flash checkpoint in the official on-disk format."))
    ap.add_argument("--out", required=True, help="output directory (new, empty, or a previous "
                    "dsv4-synth output, which is replaced)")
    ap.add_argument("--preset", choices=["tiny", "flash"], default="tiny",
                    help="tiny: §G.1 test model with the real tokenizer's vocabulary (dsv4-chat "
                    "can chat with it), 2 shards; flash: real dims, one shard per layer")
    ap.add_argument("--layers", type=int, help="decoder layers (default 5 tiny, 4 flash)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="torch device drawing the random numbers "
                    "(e.g. cuda: much faster for --preset flash; output differs from cpu)")
    ap.add_argument("--config", help="JSON file whose keys override config.json fields "
                    "(nested dicts are merged)")
    args = ap.parse_args(argv)
    try:
        overrides = {}
        if args.config:
            try:
                overrides = json.loads(Path(args.config).read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise SynthError(f"cannot read --config {args.config}: {exc}") from None
            if not isinstance(overrides, dict):
                raise SynthError(f"--config {args.config} must hold a JSON object")
        if args.layers is not None and args.layers < 1:
            raise SynthError("--layers must be >= 1")
        if args.preset == "tiny":
            cfg = chat_tiny_config(args.layers or 5, **overrides)
            options = SynthOptions(seed=args.seed, n_shards=2, device=args.device)
        else:
            cfg = flash_config(args.layers or 4, **overrides)
            options = SynthOptions(seed=args.seed, n_shards=None, device=args.device)
        if cfg["vocab_size"] < TOKENIZER_VOCAB:  # the tokenizer would not fit: no chat possible
            options = replace(options, tokenizer=False)
            print(f"note: vocab_size {cfg['vocab_size']} is smaller than the tokenizer's "
                  f"{TOKENIZER_VOCAB} tokens, so this checkpoint is logits-only: no tokenizer is "
                  "written and dsv4-chat cannot chat with it (python -m engine.logits reads it)")
        t0 = time.monotonic()
        out = write_checkpoint(args.out, cfg, options, log=print)
        index = json.loads((out / INDEX_NAME).read_text())
        print(f"wrote {out}: {len(index['weight_map'])} tensors, "
              f"{index['metadata']['total_size']:,} bytes, {time.monotonic() - t0:.1f} s")
        return 0
    except (SynthError, SafetensorsWriteError) as exc:
        print(f"dsv4-synth: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"dsv4-synth: error writing {args.out}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

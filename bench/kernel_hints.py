"""Write a kernel hints file (engine/kernel_hints/) from kernel manifests recorded on a GPU.

    python -m bench.kernel_hints MANIFEST.json... --out engine/kernel_hints/flash-sm90.json
                                 [--arch 9.0] [--tilelang 0.1.15] [--layers 43]

The manifests are those a full warm-up wrote into TileLang's cache folder
(`<cache>/dsv4-chat-manifests/*.json`, e.g. after `python -m bench.full_depth` at 100 % and 50 %:
the resident and the streamed kernels). The hints file lists their kernels once each, under the
shape key (engine/kernel_manifest.py `shape_key`) of DeepSeek-V4-Flash's real dimensions
(`dsv4-synth --preset flash`), the default EngineConfig, a converted pack, `--arch` and
`--tilelang`: a first load of that model on such a GPU compiles them in parallel before its
warm-up. Stale entries cost a compile at most (a hint that fails is skipped).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from converter.synth import flash_config
from engine.config import EngineConfig, ModelArgs
from engine.kernel_manifest import FORMAT, shape_key


def hints(manifests: list[Path], shape: str) -> dict:
    """The hints file's body: every kernel of `manifests` once, in file order."""
    seen: dict[str, dict] = {}
    for path in manifests:
        body = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("kernels"), list):
            raise SystemExit(f"bench.kernel_hints: {path} is not a format-{FORMAT} kernel manifest")
        for entry in body["kernels"]:
            seen.setdefault(json.dumps(entry, sort_keys=True), entry)
    return {"format": FORMAT, "key": "hints", "shape": shape, "kernels": list(seen.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernel_hints", description=__doc__.splitlines()[0])
    p.add_argument("manifests", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arch", default="9.0", help="compute capability of the GPU the manifests were recorded on")
    p.add_argument("--tilelang", default="0.1.15", help="TileLang version they were recorded with")
    p.add_argument("--layers", type=int, default=43)
    a = p.parse_args(argv)
    major, minor = (int(x) for x in a.arch.split("."))
    args = ModelArgs.from_dict(flash_config(a.layers), "flash")
    shape = shape_key(args, EngineConfig(), True, (major, minor), a.tilelang)
    body = hints(a.manifests, shape)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    print(f"{a.out}: {len(body['kernels'])} kernels for shape {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`dsv4-convert`: the command line of the converter (converter/convert.py, upgrade.py, verify.py).

`dsv4-convert --hf SRC --out DIR [--verify] [--no-resume] [--logits-only]` converts,
`--upgrade DIR [--verify]` rewrites a layout-1 pack in place, `--verify DIR` checks a converted
model. Progress goes to stderr; exit status 0 done, 1 failed or corrupt, 2 unfit input or
arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

from converter import preflight, verify
from converter.convert import ConvertError, ConvertProgress, ProgressFn, ProgressMeter, convert
from converter.upgrade import UpgradeError, upgrade
from engine import pack as layout


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "--:--"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _printer(stream) -> ProgressFn:
    """A progress bar redrawn in place on a terminal; a plain line every 5 s otherwise."""
    tty = stream.isatty()
    last = [0.0, ""]

    def show(p: ConvertProgress) -> None:
        frac = p.bytes_done / p.bytes_total if p.bytes_total else 1.0
        text = (f"{frac * 100:5.1f}% {p.bytes_done / 1e9:7.2f}/{p.bytes_total / 1e9:.2f} GB "
                f"{p.bytes_per_s / 1e9:5.2f} GB/s ETA {_fmt_time(p.eta_s)}  {p.current}")
        if tty:
            bar = "#" * int(frac * 30)
            stream.write(f"\r[{bar:<30}] {text}\x1b[K")
            stream.flush()
        elif time.monotonic() - last[0] >= 5 or p.current != last[1]:
            last[0], last[1] = time.monotonic(), p.current
            print(text, file=stream, flush=True)

    return show


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-convert", description=(
        "Convert an official DeepSeek-V4-Flash checkpoint into the streaming expert-pack layout "
        "(lossless, resumable); --verify DIR checks a converted model."))
    ap.add_argument("--hf", help="downloaded checkpoint directory (config.json, "
                    "model.safetensors.index.json, model-*.safetensors)")
    ap.add_argument("--out", help="output directory (new, or an earlier output)")
    ap.add_argument("--verify", nargs="?", const=True, default=False, metavar="DIR",
                    help="with --hf/--out: re-read the output against the manifest; alone: check the "
                    "converted model in DIR and name every corrupt file, tensor and expert record")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="keep verified files of an earlier run (default); --no-resume starts over")
    ap.add_argument("--logits-only", action="store_true", help="accept a tokenizer larger than the "
                    "model's vocabulary (the output serves python -m engine.logits, not chat)")
    ap.add_argument("--upgrade", metavar="DIR", help="rewrite a model converted by an older version "
                    "(layout 1) in place, without the download; resumable")
    a = ap.parse_args(argv)
    if isinstance(a.verify, str):
        if a.hf or a.out or a.upgrade is not None:
            ap.error("--verify DIR checks a converted model and takes no --hf, --out or --upgrade "
                     "(to convert and verify, put --verify after --hf and --out, without a directory)")
        return _verify_main(a.verify)
    if a.upgrade is not None:
        if a.hf or a.out:
            ap.error("--upgrade DIR takes no --hf or --out")
        return _upgrade_main(a.upgrade, a.verify)
    if not (a.hf and a.out):
        ap.error("--hf and --out are required (or --upgrade DIR, or --verify DIR)")
    show = _printer(sys.stderr)
    t0 = time.monotonic()
    out, status = _run(lambda: convert(a.hf, a.out, progress=show, resume=a.resume, verify=a.verify,
                                       notice=lambda line: print(f"dsv4-convert: {line}", file=sys.stderr),
                                       check_tokenizer=not a.logits_only),
                       ConvertError)
    if status:
        return status
    size = sum(e["size"] for e in json.loads((out / layout.MANIFEST).read_text())["files"].values())
    print(f"\nconverted {a.hf} -> {out}: {size / 1e9:.2f} GB in {time.monotonic() - t0:.1f} s"
          + (", verified" if a.verify else ""), file=sys.stderr)
    return 0


def _verify_main(path: str) -> int:
    """`dsv4-convert --verify DIR` (converter/verify.py): 0 intact; 1 corrupt: a file (every
    corrupt file, tensor and expert record named) or the manifest (unreadable, malformed, of an
    older layout, or disagreeing with its config), each problem on its own line with the fix; 2
    when DIR is no converted model (an HF download, a conversion that did not finish)."""
    root = Path(path)
    try:
        manifest = verify.read(root)
    except verify.NotConverted as e:
        print(f"dsv4-convert: {e}", file=sys.stderr)
        return 2
    except layout.LayoutError as e:  # its message has the fix
        print(f"dsv4-convert: {e}", file=sys.stderr)
        return 1
    total = sum(e["size"] for e in manifest.files.values())
    meter = ProgressMeter(total, _printer(sys.stderr))
    meter.status(f"verifying {root}")
    found = verify.check(root, manifest, meter.add)
    meter.status("done")
    if found:
        bad = [name for name in found if name != layout.MANIFEST]
        what = [f"{len(bad)} of {len(manifest.files)} files are corrupt"] if bad else []
        what += [f"its {layout.MANIFEST} is corrupt"] if layout.MANIFEST in found else []
        print(f"\ndsv4-convert: {root}: {' and '.join(what)}:", file=sys.stderr)
        for problems in found.values():
            for p in problems:
                print(f"  - {p}", file=sys.stderr)
        print("  fix: run the conversion (dsv4-convert --hf SRC --out DIR) again: it rewrites only the "
              "corrupt files", file=sys.stderr)
        return 1
    print(f"\ndsv4-convert: {root}: OK, {len(manifest.files)} files ({total / 1e9:.3f} GB) match the "
          "manifest", file=sys.stderr)
    return 0


def _run(work: Callable[[], Path], errors: type[Exception]) -> tuple[Path | None, int]:
    """(work's result, 0), or (None, the exit status) with the message printed: 2 for a
    preflight error, 130 when interrupted, 1 for `errors` and OSError."""
    try:
        return work(), 0
    except preflight.PreflightError as e:
        print(f"dsv4-convert: {e}", file=sys.stderr)
        return None, 2
    except KeyboardInterrupt:
        print("\ndsv4-convert: interrupted; run the same command again to resume", file=sys.stderr)
        return None, 130
    except (errors, OSError) as e:
        print(f"\ndsv4-convert: error: {e}", file=sys.stderr)
        return None, 1


def _upgrade_main(path: str, check: bool) -> int:
    """`dsv4-convert --upgrade DIR [--verify]` (converter/upgrade.py); the exit status."""
    t0 = time.monotonic()
    _, status = _run(lambda: upgrade(path, progress=lambda line: print(line, file=sys.stderr, flush=True)),
                     UpgradeError)
    if status:
        return status
    problems = verify.verify(Path(path)) if check else []
    if problems:
        print("dsv4-convert: verification failed:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    print(f"upgraded {path} in {time.monotonic() - t0:.1f} s" + (", verified" if check else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

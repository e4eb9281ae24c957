"""Regenerate assets/screenshots/main_generating.svg: the main screen of `dsv4-chat --demo`
while the real engine streams an answer (headless, through Textual's Pilot).

    python assets/screenshot.py [--data-dir DIR] [--out FILE.svg]

The demo model is built in DIR (default: a temp dir) by the real synth + converter.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from app.app import ChatApp
from app.demo import ensure_demo_model
from app.settings import AppConfig, GenParams


async def _shoot(data: Path, out: Path, after_s: float) -> None:
    app = ChatApp(AppConfig(data_dir=data, demo=True, gen=GenParams(max_tokens=400)), offer_resume=False)
    async with app.run_test(size=(150, 45)) as pilot:
        deadline = time.monotonic() + 180
        while not (app.service.ready and app.service.busy is None):
            if time.monotonic() > deadline:
                raise SystemExit("the demo engine did not load within 180 s")
            await pilot.pause(0.1)
        app.chat.prompt.load_text("How does the expert cache work?")
        app.chat.prompt.submit()
        await pilot.pause(after_s)  # mid-answer: tokens are streaming
        out.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=out.name, path=str(out.parent))
        app.service.cancel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "screenshots" / "main_generating.svg")
    p.add_argument("--after", type=float, default=6.0, help="seconds of streaming before the shot")
    a = p.parse_args()
    data = a.data_dir or Path(tempfile.mkdtemp(prefix="dsv4-shot-"))
    ensure_demo_model(data, lambda event: None)
    asyncio.run(_shoot(data, a.out, a.after))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

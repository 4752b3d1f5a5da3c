"""Screenshots of memfit ui's views for the docs, taken in Debian's chromium driven by Playwright.

Starts `python -m memfit ui --port 0` (this interpreter) with a run folder made by a short demo
training run (``memfit train examples/tiny.yaml --budget 4GiB`` on the CPU: planned against the budget), opens each view of Llama-3.1-8B
on an RTX 4090 and writes ``docs/img/ui-plan.png``, ``ui-context.png``, ``ui-fit.png`` and
``ui-run.png``. Every figure on them is what the server answered at the time; the search runs in
full (minutes from an empty plan cache).

    python scripts/ui_screenshots.py [--out docs/img] [--chromium /usr/bin/chromium] [--views plan,context,fit,run]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEW = "model=llama-3.1-8b&gpu=rtx-4090&seq_len=4096"
WAIT_MS = 30 * 60 * 1000


def demo_run(folder: Path) -> Path:
    """A short real training run of the demo config (CPU), its memory recorded against its plan."""
    run_dir = folder / "run"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit",
            "train",
            str(REPO / "examples" / "tiny.yaml"),
            "-o",
            str(run_dir),
            "--max-steps",
            "8",
            "--no-progress",
            "--budget",
            "4GiB",
        ],
        check=True,
    )  # a budget: the CPU run is planned
    return run_dir


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--views", default="plan,context,fit,run", help="which screenshots to take (comma-separated)")
    args = parser.parse_args()
    views = set(args.views.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="memfit-ui-shots-") as work:
        run_dir = demo_run(Path(work))
        server = subprocess.Popen(
            [sys.executable, "-m", "memfit", "ui", "--port", "0", "--run", str(run_dir)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            base = server.stdout.readline().split()[2]
            with sync_playwright() as playwright:
                context = playwright.chromium.launch_persistent_context(
                    str(Path(work) / "profile"),
                    executable_path=args.chromium,
                    headless=True,
                    args=FLAGS,
                    viewport={"width": 1400, "height": 900},
                    device_scale_factor=1,
                )
                page = context.new_page()
                page.goto(f"{base}?{VIEW}")
                page.wait_for_function("document.querySelector('#device-total').dataset.bytes", timeout=WAIT_MS)
                page.wait_for_selector("#busy-plan[hidden]", state="attached", timeout=WAIT_MS)
                if "plan" in views:
                    page.screenshot(path=args.out / "ui-plan.png", full_page=True)
                if "context" in views:
                    page.click("[data-view=context]")
                    page.wait_for_function(
                        "document.querySelector('#longest').dataset.tokens !== undefined", timeout=WAIT_MS
                    )
                    page.screenshot(path=args.out / "ui-context.png", full_page=True)
                if "fit" in views:
                    page.click("[data-view=fit]")
                    page.click("#fit-start")
                    page.wait_for_function(
                        "document.querySelector('#fit-summary').dataset.count !== undefined", timeout=WAIT_MS
                    )
                    page.screenshot(path=args.out / "ui-fit.png", full_page=True)
                if "run" in views:
                    page.click("[data-view=run]")
                    page.wait_for_selector("#run-table:not([hidden])", timeout=WAIT_MS)
                    page.screenshot(path=args.out / "ui-run.png", full_page=True)
                context.close()
        finally:
            server.terminate()
            server.wait(timeout=120)
    print(f"wrote {', '.join(p.name for p in sorted(args.out.glob('ui-*.png')))} to {args.out}")


if __name__ == "__main__":
    main()

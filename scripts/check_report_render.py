"""Check that a ``memfit report`` page renders in a real browser (headless Chromium).

    python scripts/check_report_render.py RUN_DIR              # writes RUN_DIR/report.html, then checks it
    python scripts/check_report_render.py path/to/report.html  # checks an existing page
    python scripts/check_report_render.py --demo               # records a short real CPU run first

The page is opened from disk with networking off and screenshotted whole: 1200 pixels wide and
taller than any report, cut below its last line of content (a fixed-height window shows blank space
under a short page, which says nothing about the page). The page is then checked for content:
enough non-white pixels, enough distinct colours that charts (not just text) were drawn, and no
blank band taller than MAX_BLANK_BAND_PX inside it (an empty chart or section). Exit codes: 0
rendered, 1 blank or failed, 77 no Chromium installed (skipped).
Install Chromium on Debian/Ubuntu with ``apt-get install -y chromium``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SKIPPED = 77
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

#: A blank or failed page is white (or one flat colour); a report has text and coloured charts.
MIN_INK_FRACTION = 0.02
MIN_COLOURS = 64
#: The window's height: taller than a report (the screenshot is cut below the content).
WINDOW_HEIGHT_PX = 12000
#: Blank space between two parts of the page: the gap after a heading is ~40 pixels, a chart's
#: margins less; an empty chart or a section with nothing in it is taller than this.
MAX_BLANK_BAND_PX = 300


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(browser: str, page: Path, png: Path, timeout_s: float = 90.0) -> None:
    with tempfile.TemporaryDirectory(prefix="memfit-chromium-") as profile:
        command = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--screenshot={png}",
            f"--window-size=1200,{WINDOW_HEIGHT_PX}",
            "--hide-scrollbars",
            page.resolve().as_uri(),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not png.is_file():
        raise RuntimeError(f"{browser} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")


def content_rows(png: Path):
    """The screenshot's pixels (RGB, 0-1) from the top to its last row with anything on it, and for
    each row whether it holds anything (a pixel that is not near-white)."""
    import matplotlib.image as mpimg

    pixels = mpimg.imread(str(png))[..., :3]
    inked = (pixels < 0.94).any(axis=-1).any(axis=-1)
    last = int(inked.nonzero()[0].max()) + 1 if inked.any() else 0
    return pixels[:last], inked[:last]


def ink(pixels) -> tuple[float, int]:
    """(share of pixels that are not near-white, number of distinct colours) of the page's pixels."""
    import numpy as np

    if not len(pixels):
        return 0.0, 0
    not_white = (pixels < 0.94).any(axis=-1)
    quantised = (pixels * 255).astype(np.uint8).reshape(-1, 3)
    colours = len(np.unique(quantised, axis=0))
    return float(not_white.mean()), int(colours)


def tallest_blank_band(inked) -> tuple[int, int]:
    """(height, top row) of the tallest run of blank rows between the page's first and last content."""
    best, top, run_start = 0, 0, None
    first = int(inked.nonzero()[0].min()) if inked.any() else 0
    for row in range(first, len(inked)):
        if not inked[row]:
            run_start = row if run_start is None else run_start
        elif run_start is not None:
            if row - run_start > best:
                best, top = row - run_start, run_start
            run_start = None
    return best, top


def demo_run(folder: Path) -> Path:
    """A real 80-step CPU run of a tiny llama with a 3 MiB-per-step leak, recorded with a plan, its
    loss, learning rate and an evaluation every 20 steps."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from memfit.models.build import make_config
    from memfit.planner.api import plan
    from memfit.spec import make_spec
    from memfit.step.losses import causal_lm_loss
    from memfit.step.optim import build_optimizer
    from memfit.step.prepare import attach_lora, enable_checkpointing
    from memfit.step.train_step import train_step
    from memfit.watch.recorder import MemoryRecorder

    torch.set_num_threads(1)
    tiny = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    knobs = dict(method="lora", rank=4, precision="fp32", batch_size=2, seq_len=32, checkpointing="on")
    spec = make_spec(**knobs)
    torch.manual_seed(0)
    model = attach_lora(AutoModelForCausalLM.from_config(make_config(tiny), attn_implementation="sdpa"), spec)
    enable_checkpointing(model)
    model.train()
    optimizer = build_optimizer(model.parameters(), "adamw", lr=1e-2)
    ids, held_out = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    batch = {"input_ids": ids, "labels": ids.clone()}
    run = folder / "demo-run"
    kept = []
    with (
        MemoryRecorder(run, expected_device="cpu", plan=plan(tiny, **knobs), spec=spec, total_steps=80) as recorder,
        open(run / "metrics.jsonl", "w") as metrics,
    ):
        recorder.inspect(model, spec)
        for step in range(80):
            if step == 0:
                recorder.attribute(model, optimizer)
            loss, _ = train_step(model, [batch], optimizer, loss_fn=causal_lm_loss, observer=recorder.observer)
            kept.append(torch.empty(3 * 2**20, dtype=torch.uint8).fill_(1))
            recorder.end_step(step + 1, {"loss": float(loss)})
            lr = optimizer.param_groups[0]["lr"]
            metrics.write(json.dumps({"step": step + 1, "loss": float(loss), "lr": lr}) + "\n")
            if (step + 1) % 20 == 0:
                with torch.no_grad():
                    eval_loss = float(causal_lm_loss(model, {"input_ids": held_out, "labels": held_out}))
                metrics.write(json.dumps({"step": step + 1, "eval_loss": eval_loss}) + "\n")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", help="a run folder or a report .html")
    parser.add_argument("--demo", action="store_true", help="record a short real CPU run and check its report")
    parser.add_argument("--screenshot", type=Path, help="where to keep the screenshot (default: a temporary file)")
    args = parser.parse_args(argv)
    if not args.demo and not args.target:
        parser.error("give a run folder, a report .html, or --demo")

    browser = find_browser()
    if browser is None:
        print(f"skipped: no Chromium found ({', '.join(BROWSERS)}); install it with: apt-get install -y chromium")
        return SKIPPED

    from memfit.watch.report import write_report

    workdir = Path(tempfile.mkdtemp(prefix="memfit-render-"))
    if args.demo:
        page = write_report(demo_run(workdir))
    else:
        target = Path(args.target)
        page = write_report(target) if target.is_dir() else target
    png = args.screenshot or workdir / "screenshot.png"
    try:
        screenshot(browser, page, png)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"FAILED: {page} did not render: {err}")
        return 1
    pixels, inked = content_rows(png)
    if len(pixels):
        import matplotlib.image as mpimg

        mpimg.imsave(str(png), pixels)  # the page, without the window's blank space below it
    ink_fraction, colours = ink(pixels)
    band, band_top = tallest_blank_band(inked)
    print(f"page: {page}")
    print(
        f"screenshot: {png} (page {len(inked)} pixels tall, {ink_fraction:.1%} of its pixels not white, "
        f"{colours} distinct colours, tallest blank band {band} pixels)"
    )
    if len(inked) >= WINDOW_HEIGHT_PX:
        print(f"FAILED: the page is taller than the {WINDOW_HEIGHT_PX}-pixel window; its end was not seen")
        return 1
    if ink_fraction < MIN_INK_FRACTION or colours < MIN_COLOURS:
        print(f"FAILED: the screenshot looks blank (need >= {MIN_INK_FRACTION:.0%} ink and >= {MIN_COLOURS} colours)")
        return 1
    if band > MAX_BLANK_BAND_PX:
        print(
            f"FAILED: a blank band {band} pixels tall from {band_top} pixels down (an empty chart or section; at most "
            f"{MAX_BLANK_BAND_PX})"
        )
        return 1
    print("OK: the report rendered with text and charts")
    return 0


if __name__ == "__main__":
    sys.exit(main())

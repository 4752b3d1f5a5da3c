"""Vision-language training data that cannot train: a missing or unreadable image, more image tokens
than seq_len holds, more images than the run plans, images that do not match the image parts. Each
is one line naming the file and line and the fix, exit 2, before any model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ._case import Case

#: The prefix of every file these cases name.
_P = "vlm"
_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm-tiny"


def _record(images: list[str], parts: int = 1) -> str:
    content = [{"type": "image"}] * parts + [{"type": "text", "text": "What is it?"}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "A red circle."}]
    return json.dumps({"messages": messages, "images": images}) + "\n"


def _train_yaml(root: Path, data: str, **fields) -> str:
    """A training YAML of the tiny LLaVA on ``data`` (a file under the inputs folder)."""
    settings = {
        "model": str(root / f"{_P}-config.json"),
        "init": "random",
        "data": str(root / data),
        "method": "lora",
        "precision": "fp32",
        "batch_size": 1,
        "seq_len": 64,
        "max_steps": 1,
        "device": "cpu",
        "output_dir": str(root / f"{_P}-run"),
        **fields,
    }
    return "".join(f"{key}: {json.dumps(value)}\n" for key, value in settings.items())


def make_inputs(root: Path) -> None:
    """The tiny LLaVA's config, a picture, a file that is no picture, and data files wrong one way each."""
    shutil.copy(_EXAMPLE / "config.json", root / f"{_P}-config.json")
    shutil.copy(_EXAMPLE / "images" / "red-circle.png", root / f"{_P}-red.png")
    (root / f"{_P}-broken.png").write_text("not a picture")
    good = _record([f"{_P}-red.png"])
    files = {
        f"{_P}-missing.jsonl": good + _record([f"{_P}-gone.png"]),
        f"{_P}-unreadable.jsonl": _record([f"{_P}-broken.png"]),
        f"{_P}-two.jsonl": good + _record([f"{_P}-red.png", f"{_P}-red.png"], parts=2),
        f"{_P}-mismatch.jsonl": _record([f"{_P}-red.png"], parts=2),
        f"{_P}-missing.yaml": _train_yaml(root, f"{_P}-missing.jsonl"),
        f"{_P}-unreadable.yaml": _train_yaml(root, f"{_P}-unreadable.jsonl"),
        f"{_P}-short.yaml": _train_yaml(root, f"{_P}-two.jsonl", seq_len=12, images=2),
        f"{_P}-two.yaml": _train_yaml(root, f"{_P}-two.jsonl"),
        f"{_P}-mismatch.yaml": _train_yaml(root, f"{_P}-mismatch.jsonl"),
        f"{_P}-axolotl.yml": "base_model: org/model\nprocessor_type: AutoProcessor\nimage_size: [1, 2, 3]\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)


CASES = [
    Case(
        f"train {{d}}/{_P}-missing.yaml",
        2,
        fast=True,
        says=(f"{_P}-missing.jsonl, line 2: images[0]: no file", "give the image's path relative to the data file"),
        keeps=(f"{_P}-missing.jsonl",),
    ),
    Case(
        f"train {{d}}/{_P}-unreadable.yaml",
        2,
        says=(f"{_P}-unreadable.jsonl, line 1: images[0]: cannot read", "replace the file"),
        keeps=(f"{_P}-broken.png",),
    ),
    Case(
        f"train {{d}}/{_P}-short.yaml",
        2,
        says=(f"{_P}-two.jsonl, line 1: seq_len: 12 cuts its image tokens", "raise seq_len to"),
    ),
    Case(
        f"train {{d}}/{_P}-two.yaml",
        2,
        says=(f"{_P}-two.jsonl, line 2: images: 2 images, more than images: 1", "set images: 2"),
    ),
    Case(
        f"train {{d}}/{_P}-mismatch.yaml",
        2,
        says=(f"{_P}-mismatch.jsonl, line 1: images: 1 image(s) but 2 image part(s)",),
    ),
    Case(
        f"plan {{d}}/{_P}-axolotl.yml",
        2,
        fast=True,
        says=("image_size", "give one side (512) or [width, height]"),
    ),
]

"""Writes examples/vlm-tiny/: six small pictures (a shape of one colour on a light ground) and a JSON
Lines file of questions about them in TRL's vision format (messages with image parts, images by path).

    python scripts/make_vlm_example.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

FOLDER = Path(__file__).resolve().parent.parent / "examples" / "vlm-tiny"
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220)}
SHAPES = ("square", "circle")
QUESTIONS = ("What is in the picture?", "Describe the image.", "What do you see?", "Name the shape and its colour.")


def draw(colour: tuple[int, int, int], shape: str, side: int = 48) -> Image.Image:
    """A ``shape`` of ``colour`` in the middle of a light ``side`` x ``side`` picture."""
    picture = Image.new("RGB", (side, side), (235, 235, 225))
    pen = ImageDraw.Draw(picture)
    box = (side // 6, side // 6, side - side // 6, side - side // 6)
    (pen.rectangle if shape == "square" else pen.ellipse)(box, fill=colour)
    return picture


def main() -> None:
    (FOLDER / "images").mkdir(parents=True, exist_ok=True)
    names = []
    for colour, rgb in COLOURS.items():
        for shape in SHAPES:
            name = f"images/{colour}-{shape}.png"
            draw(rgb, shape).save(FOLDER / name, optimize=True)
            names.append((name, colour, shape))
    rng = random.Random(0)
    with open(FOLDER / "data.jsonl", "w", encoding="utf-8") as handle:
        for index in range(60):
            name, colour, shape = names[index % len(names)]
            record = {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": rng.choice(QUESTIONS)}]},
                    {"role": "assistant", "content": [{"type": "text", "text": f"A {colour} {shape}."}]},
                ],
                "images": [name],
            }
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()

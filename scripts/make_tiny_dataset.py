"""Write the small demo instruction dataset (shipped inside the package) and the format examples.

``tiny-instruct.jsonl``, the demo dataset, is package data (src/memfit/assets/data/): ``memfit fit
--write`` points a config at the installed copy, so it must exist without a source checkout. The
small examples of each data format live under examples/data/.

The records are generated, not collected: short arithmetic, word and fact tasks whose answers follow
a fixed pattern, so that a tiny model's loss falls visibly within about a hundred steps. The output
is deterministic (fixed seed); re-running the script rewrites the same bytes.

    python scripts/make_tiny_dataset.py            # writes src/memfit/assets/data/ and examples/data/
    python scripts/make_tiny_dataset.py --check    # exits 1 if the committed files differ
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
from pathlib import Path

from memfit.files import write_or_check

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "examples" / "data"
#: Where the demo dataset lives: inside the package, installed with it.
DEMO_DIR = ROOT / "src" / "memfit" / "assets" / "data"
DEMO_FILE = "tiny-instruct.jsonl"
SEED = 20240601
NUM_MAIN_RECORDS = 320

WORDS = [
    "apple",
    "river",
    "garden",
    "pencil",
    "window",
    "rocket",
    "silver",
    "planet",
    "forest",
    "candle",
    "bridge",
    "yellow",
    "basket",
    "tiger",
    "cloud",
    "marble",
    "winter",
    "summer",
    "ladder",
    "button",
    "orange",
    "guitar",
    "island",
    "puzzle",
    "violet",
    "copper",
    "meadow",
    "harbor",
    "lemon",
    "castle",
]
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "up": "down",
    "early": "late",
    "open": "closed",
    "light": "dark",
    "happy": "sad",
    "old": "new",
    "full": "empty",
    "high": "low",
    "hard": "soft",
    "wet": "dry",
    "near": "far",
    "thick": "thin",
    "loud": "quiet",
}
# Plain, stable facts only: the names of the days, months and the basic colours of common things.
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
SYSTEM_PROMPTS = ["You are a concise assistant.", "Answer in one short sentence."]


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."


def _sub(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(10, 60)
    b = rng.randint(1, a)
    return f"What is {a} - {b}?", f"{a} - {b} = {a - b}."


def _mul(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"What is {a} times {b}?", f"{a} x {b} = {a * b}."


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Reverse the word '{word}'.", f"The reverse of '{word}' is '{word[::-1]}'."


def _upper(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Write '{word}' in capital letters.", f"'{word}' in capital letters is '{word.upper()}'."


def _length(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"How many letters are in '{word}'?", f"'{word}' has {len(word)} letters."


def _first_letter(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"What is the first letter of '{word}'?", f"The first letter of '{word}' is '{word[0]}'."


def _opposite(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(sorted(OPPOSITES))
    return f"What is the opposite of '{word}'?", f"The opposite of '{word}' is '{OPPOSITES[word]}'."


def _larger(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(1, 100), 2)
    return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger than {min(a, b)}."


def _next_day(rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(len(DAYS))
    return f"What day comes after {DAYS[i]}?", f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}."


def _next_month(rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(len(MONTHS))
    return (
        f"What month comes after {MONTHS[i]}?",
        f"The month after {MONTHS[i]} is {MONTHS[(i + 1) % 12]}.",
    )


def _even_odd(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(1, 99)
    return f"Is {n} even or odd?", f"{n} is {'even' if n % 2 == 0 else 'odd'}."


TASKS = [
    _add,
    _sub,
    _mul,
    _reverse,
    _upper,
    _length,
    _first_letter,
    _opposite,
    _larger,
    _next_day,
    _next_month,
    _even_odd,
]


def main_records(rng: random.Random, count: int) -> list[dict]:
    """The messages-format records of tiny-instruct.jsonl: mostly one turn, some with a system
    prompt, some with two exchanges."""
    records = []
    for index in range(count):
        messages = []
        if index % 5 == 0:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        turns = 2 if index % 7 == 3 else 1
        for _ in range(turns):
            question, answer = rng.choice(TASKS)(rng)
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        records.append({"messages": messages})
    return records


def alpaca_records(rng: random.Random) -> list[dict]:
    records = []
    for task in (_add, _reverse, _opposite, _next_day, _even_odd, _mul):
        question, answer = task(rng)
        records.append({"instruction": question, "input": "", "output": answer})
    # The optional "input" field carries the material the instruction works on.
    word = rng.choice(WORDS)
    records.append(
        {
            "instruction": "Reverse the word given as input.",
            "input": word,
            "output": f"The reverse of '{word}' is '{word[::-1]}'.",
        }
    )
    return records


def sharegpt_records(rng: random.Random) -> list[dict]:
    records = []
    for index in range(6):
        conversation = []
        if index == 0:
            conversation.append({"from": "system", "value": SYSTEM_PROMPTS[0]})
        for _ in range(1 + index % 2):
            question, answer = rng.choice(TASKS)(rng)
            conversation.append({"from": "human", "value": question})
            conversation.append({"from": "gpt", "value": answer})
        records.append({"conversations": conversation})
    return records


def text_records(rng: random.Random) -> list[dict]:
    records = []
    for _ in range(6):
        lines = [" ".join(rng.choice(TASKS)(rng)) for _ in range(3)]
        records.append({"text": "\n".join(lines)})
    return records


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def _csv(records: list[dict], fields: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    return buffer.getvalue()


def render_files() -> dict[str, str]:
    """File name -> file text, for every file this script owns (the demo dataset and the examples)."""
    rng = random.Random(SEED)
    alpaca = alpaca_records(rng)
    return {
        "tiny-instruct.jsonl": _jsonl(main_records(rng, NUM_MAIN_RECORDS)),
        "alpaca-example.json": json.dumps(alpaca, indent=2, ensure_ascii=False) + "\n",
        "alpaca-example.csv": _csv(alpaca, ["instruction", "input", "output"]),
        "sharegpt-example.jsonl": _jsonl(sharegpt_records(rng)),
        "text-example.jsonl": _jsonl(text_records(rng)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="write every file here instead (default: the two folders)"
    )
    parser.add_argument("--check", action="store_true", help="compare with the files on disk; write nothing")
    args = parser.parse_args(argv)
    files = render_files()
    if args.out_dir is not None:
        return write_or_check(args.out_dir, files, check=args.check)
    demo = {DEMO_FILE: files.pop(DEMO_FILE)}
    return max(write_or_check(DEMO_DIR, demo, check=args.check), write_or_check(OUT_DIR, files, check=args.check))


if __name__ == "__main__":
    raise SystemExit(main())

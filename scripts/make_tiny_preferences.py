"""Write the small demo preference dataset (shipped inside the package) and the pair format examples.

``tiny-preferences.jsonl`` holds 320 chosen / rejected pairs for the DPO, ORPO and SimPO demo
(examples/dpo-tiny.yaml). Like tiny-instruct.jsonl it is generated, not collected, from the same
short tasks: the chosen answer is the task's answer in a full sentence; the rejected one is a curt
non-answer ("Not telling.") for half of the pairs and, for the other half, the same sentence with a
wrong result. The first half is a pattern a tiny random-weight model learns within a few dozen
steps, so ``rewards/accuracies`` rises above 0.5 quickly; the second asks for more. The output is
deterministic (fixed seed); re-running the script rewrites the same bytes.

    python scripts/make_tiny_preferences.py            # writes src/memfit/assets/data/ and examples/data/
    python scripts/make_tiny_preferences.py --check    # exits 1 if the committed files differ
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_dataset import DEMO_DIR, OUT_DIR, SYSTEM_PROMPTS, TASKS

from memfit.files import write_or_check

DEMO_FILE = "tiny-preferences.jsonl"
SEED = 20240717
NUM_PAIRS = 320

CURT = ["Not telling.", "Figure it out yourself.", "No idea.", "Whatever.", "Ask someone else.", "I won't answer that."]


def _wrong(answer: str, rng: random.Random) -> str:
    """The answer with its result changed: the last number moved, or the last quoted word reversed."""
    numbers = list(re.finditer(r"\d+", answer))
    if numbers:
        last = numbers[-1]
        right = int(last.group())
        value = right + rng.choice([1, 2, 3]) * (rng.choice([-1, 1]) if right > 3 else 1)
        return answer[: last.start()] + str(value) + answer[last.end() :]
    quoted = list(re.finditer(r"'([^']+)'", answer))
    if quoted:
        last = quoted[-1]
        word = last.group(1)
        swapped = word[::-1] if word[::-1] != word else word + "s"
        return answer[: last.start(1)] + swapped + answer[last.end(1) :]
    words = answer.rstrip(".").split()
    return " ".join(words[:-1] + ["maybe"]) + "."


def pairs(rng: random.Random, count: int) -> list[dict]:
    """Chat pairs in TRL's explicit-prompt form: prompt turns, then one assistant turn each."""
    records = []
    for index in range(count):
        question, answer = rng.choice(TASKS)(rng)
        prompt = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if index % 5 == 0 else []
        prompt.append({"role": "user", "content": question})
        rejected = rng.choice(CURT) if index % 2 == 0 else _wrong(answer, rng)
        records.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return records


def text_pairs(rng: random.Random) -> list[dict]:
    """A few text pairs: explicit prompt, and the implicit-prompt form (chosen and rejected share it)."""
    records = []
    for index in range(6):
        question, answer = rng.choice(TASKS)(rng)
        rejected = rng.choice(CURT) if index % 2 == 0 else _wrong(answer, rng)
        if index < 4:
            records.append({"prompt": f"Q: {question}\nA:", "chosen": f" {answer}", "rejected": f" {rejected}"})
        else:
            records.append({"chosen": f"Q: {question}\nA: {answer}", "rejected": f"Q: {question}\nA: {rejected}"})
    return records


def conversation_pairs(rng: random.Random) -> list[dict]:
    """Whole conversations that share their prompt turns (TRL's implicit prompt, conversational)."""
    records = []
    for index in range(4):
        question, answer = rng.choice(TASKS)(rng)
        rejected = rng.choice(CURT) if index % 2 == 0 else _wrong(answer, rng)
        user = {"role": "user", "content": question}
        records.append(
            {
                "chosen": [user, {"role": "assistant", "content": answer}],
                "rejected": [user, {"role": "assistant", "content": rejected}],
            }
        )
    return records


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def render_files() -> dict[str, dict[str, str]]:
    """Folder -> (file name -> file text), for every file this script owns."""
    rng = random.Random(SEED)
    return {
        str(DEMO_DIR): {DEMO_FILE: _jsonl(pairs(rng, NUM_PAIRS))},
        str(OUT_DIR): {
            "preference-text-example.jsonl": _jsonl(text_pairs(rng)),
            "preference-conversations-example.jsonl": _jsonl(conversation_pairs(rng)),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = parser.parse_args()
    code = 0
    for folder, files in render_files().items():
        code = max(code, write_or_check(folder, files, check=args.check))
    return code


if __name__ == "__main__":
    raise SystemExit(main())

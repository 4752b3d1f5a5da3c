"""Write the review-sentiment task the real-model benchmark trains on, and its held-out probes.

``reviews-sentiment.jsonl``: short made-up reviews, each asked "positive or negative?" and answered
with the one word. ``reviews-sentiment-probes.jsonl``: reviews built from adjectives and subjects
that no training record uses, with the expected answer; they are prompts for ``memfit generate``
(``{"prompt": ..., "answer": ...}``). A pretrained instruct model knows which adjectives are kind;
what it does not know is that the answer is that one word, which a few LoRA steps teach, and the
probes check it on words it was not trained on.

Both are package data (src/memfit/assets/data/), so the benchmark runs from an installed memfit.
The output is deterministic (fixed seed); re-running the script rewrites the same bytes.

    python scripts/make_sentiment_dataset.py            # writes the two files
    python scripts/make_sentiment_dataset.py --check    # exits 1 if the committed files differ
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from memfit.files import write_or_check

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "src" / "memfit" / "assets" / "data"
TRAIN_FILE = "reviews-sentiment.jsonl"
PROBES_FILE = "reviews-sentiment-probes.jsonl"
SEED = 20261125
NUM_TRAIN = 256

QUESTION = "Review: {review}\nIs this review positive or negative?"

TRAIN_WORDS = {
    "positive": [
        "wonderful",
        "delicious",
        "friendly",
        "excellent",
        "fantastic",
        "lovely",
        "great",
        "amazing",
        "perfect",
        "delightful",
        "brilliant",
        "charming",
        "pleasant",
        "enjoyable",
        "comfortable",
        "beautiful",
        "fresh",
        "helpful",
        "impressive",
        "cozy",
    ],
    "negative": [
        "terrible",
        "awful",
        "rude",
        "disgusting",
        "horrible",
        "dirty",
        "boring",
        "broken",
        "bland",
        "disappointing",
        "noisy",
        "overpriced",
        "stale",
        "unhelpful",
        "dreadful",
        "poor",
        "ugly",
        "painful",
        "greasy",
        "cramped",
    ],
}
TRAIN_SUBJECTS = [
    "the food",
    "the service",
    "the staff",
    "the room",
    "the movie",
    "the book",
    "the hotel",
    "the pizza",
    "the concert",
    "the phone",
    "the coffee",
    "the show",
    "the game",
    "the bakery",
    "the train ride",
    "the museum",
    "the laptop",
    "the soup",
    "the flight",
    "the garden",
]
PROBE_WORDS = {
    "positive": ["marvelous", "splendid", "terrific", "gorgeous", "superb", "outstanding", "heavenly", "flawless"],
    "negative": ["atrocious", "mediocre", "filthy", "horrendous", "lousy", "revolting", "miserable", "shabby"],
}
PROBE_SUBJECTS = [
    "the dessert",
    "the waiter",
    "the apartment",
    "the novel",
    "the festival",
    "the headphones",
    "the sandwich",
    "the tour",
    "the lecture",
    "the spa",
    "the bicycle",
    "the podcast",
]
TEMPLATES = [
    "{Subject} was {word}.",
    "I thought {subject} was {word}.",
    "Honestly, {subject} was {word}.",
    "We found {subject} {word} from start to finish.",
    "{Subject} was {word}, and I would say so again.",
    "My friends agreed that {subject} was {word}.",
]


def review(rng: random.Random, words: list[str], subjects: list[str]) -> str:
    subject, word = rng.choice(subjects), rng.choice(words)
    return rng.choice(TEMPLATES).format(subject=subject, Subject=subject[0].upper() + subject[1:], word=word)


def make_files() -> dict[str, str]:
    rng = random.Random(SEED)
    train = []
    for index in range(NUM_TRAIN):
        label = ("positive", "negative")[index % 2]
        text = review(rng, TRAIN_WORDS[label], TRAIN_SUBJECTS)
        train.append(
            {
                "messages": [
                    {"role": "user", "content": QUESTION.format(review=text)},
                    {"role": "assistant", "content": label},
                ]
            }
        )
    probes = []
    for label in ("positive", "negative"):
        for word in PROBE_WORDS[label]:
            subject = rng.choice(PROBE_SUBJECTS)
            text = rng.choice(TEMPLATES).format(subject=subject, Subject=subject[0].upper() + subject[1:], word=word)
            probes.append({"prompt": QUESTION.format(review=text), "answer": label})
    rng.shuffle(probes)

    def jsonl(records: list[dict]) -> str:
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)

    return {TRAIN_FILE: jsonl(train), PROBES_FILE: jsonl(probes)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed files")
    args = parser.parse_args()
    return write_or_check(OUT_DIR, make_files(), check=args.check)


if __name__ == "__main__":
    raise SystemExit(main())

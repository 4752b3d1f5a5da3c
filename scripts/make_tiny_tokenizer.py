"""Train the tiny byte-level BPE tokenizer shipped in src/memfit/assets/tokenizer/.

It is trained on the demo files named in CORPUS_FILES (run scripts/make_tiny_dataset.py first), with
512 tokens in all: 256 byte tokens, 7 special tokens and the most frequent merges. Digits are split
one by one, which helps tiny models with the arithmetic records. The output loads offline with
``transformers.AutoTokenizer.from_pretrained(path)``:

- tokenizer.json: the tokenizers-library model (BPE, byte-level, BOS added to plain text),
- tokenizer_config.json: special tokens, the chat template (Jinja), the tokenizer class,
- special_tokens_map.json: the special tokens, as transformers 4.x writes them.

    python scripts/make_tiny_tokenizer.py            # writes src/memfit/assets/tokenizer/
    python scripts/make_tiny_tokenizer.py --check    # exits 1 if the committed files differ
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memfit.files import write_or_check

ROOT = Path(__file__).resolve().parents[1]
#: The demo data: the format examples, and the demo dataset shipped inside the package.
DATA_DIRS = (ROOT / "examples" / "data", ROOT / "src" / "memfit" / "assets" / "data")
#: The files the tokenizer is trained on, by name: a data file added to those folders later (a
#: benchmark's task, preference pairs) must not change the shipped tokenizer's merges and ids.
CORPUS_FILES = ("alpaca-example.json", "sharegpt-example.jsonl", "text-example.jsonl", "tiny-instruct.jsonl")
OUT_DIR = ROOT / "src" / "memfit" / "assets" / "tokenizer"
VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 4096

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *CHAT_MARKERS]  # ids 0..6 in this order

# Each turn: role marker, newline, content, <|end|>. The assistant's answer is followed directly by
# <|end|> (no newline), so the trained tokens of a turn are exactly its content and <|end|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_lines(data_dirs: list[Path]) -> list[str]:
    """Every text the demo data holds, in file-name order; chat turns rendered with the template's
    markers so common marker-adjacent text (newline, first words) gets merges too."""
    lines: list[str] = []
    for path in sorted(
        (p for d in data_dirs for p in d.glob("*.jsonl") if p.name in CORPUS_FILES), key=lambda p: p.name
    ):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if "text" in record:
                lines.append(record["text"])
            for turn in record.get("messages", []):
                lines.append(f"<|{turn['role']}|>\n{turn['content']}<|end|>")
            for turn in record.get("conversations", []):
                lines.append(turn["value"])
    for path in sorted(
        (p for d in data_dirs for p in d.glob("*.json") if p.name in CORPUS_FILES), key=lambda p: p.name
    ):
        for record in json.loads(path.read_text(encoding="utf-8")):
            lines += [record["instruction"], record.get("input", ""), record["output"]]
    return [line for line in lines if line]


def build_tokenizer(lines: list[str]):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    # BOS before plain text (tokenizer(text)); chat templates write their own BOS and are encoded
    # with add_special_tokens=False.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))]
    )
    return tokenizer


def _token_entry(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def render_files(data_dirs: list[Path]) -> dict[str, str]:
    """File name -> file text for the tokenizer directory."""
    tokenizer = build_tokenizer(corpus_lines(data_dirs))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = {
        "added_tokens_decoder": {str(ids[t]): {**_token_entry(t), "special": True} for t in SPECIAL_TOKENS},
        "additional_special_tokens": CHAT_MARKERS,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {
        "additional_special_tokens": [_token_entry(t) for t in CHAT_MARKERS],
        "bos_token": _token_entry(BOS),
        "eos_token": _token_entry(EOS),
        "pad_token": _token_entry(PAD),
    }
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special_map, indent=2) + "\n",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir", type=Path, action="append", help="a folder of demo data (repeatable; default: both demo folders)"
    )
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--check", action="store_true", help="compare with the files on disk; write nothing")
    args = parser.parse_args(argv)
    data_dirs = args.data_dir or list(DATA_DIRS)
    if not any(p for d in data_dirs for p in d.glob("*.jsonl")):
        print(
            f"no .jsonl files in {', '.join(map(str, data_dirs))}; run scripts/make_tiny_dataset.py first",
            file=sys.stderr,
        )
        return 2
    files = render_files(data_dirs)
    return write_or_check(args.out_dir, files, check=args.check)


if __name__ == "__main__":
    raise SystemExit(main())

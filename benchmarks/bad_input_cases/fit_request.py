"""Bad inputs of `memfit fit` as its request is made of them: whole numbers that are not, beside bad
knobs, all named at once before any plan, for a model, another tool's config and memfit's own
training YAML (the command line's fields, knobs and GPU count reach each search alike)."""

from __future__ import annotations

import json
from pathlib import Path

from ._case import Case

#: A Llama small enough to plan in a second.
_TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

CASES = [
    # Every problem at once: the effective batch, the length, a knob and the GPU count.
    Case(
        "fit {d}/fitreq_model/config.json --budget 2GiB --batch-size x --seq-len 0 --gpus -2 --rank 0",
        2,
        fast=True,
        says=(
            "--batch-size: 'x' is not a whole number",
            "--seq-len: 0 must be 1 or more",
            "--rank: 0 must be 1 or more",
            "--gpus: -2 must be 1 or more",
        ),
    ),
    Case(
        "fit {d}/fitreq_model/config.json --budget 2GiB --batch-size 5000",
        2,
        says=("--batch-size: 5000 must be at most 4096: fit plans micro-batch 1",),
    ),
    # Another tool's config: what is given replaces the config's, and is checked as for a model.
    Case(
        "fit {d}/fitreq_axolotl.yml --budget 2GiB --seq-len x --batch-size 0",
        2,
        says=("--batch-size: 0 must be 1 or more", "--seq-len: 'x' is not a whole number"),
        keeps=("fitreq_axolotl.yml",),
    ),
    # memfit's own training YAML: read as memfit train reads it, the command line on top.
    Case(
        "fit {d}/fitreq_memfit.yaml --budget 2GiB --gpus x",
        2,
        says=("gpus: 'x' is not a whole number",),
        keeps=("fitreq_memfit.yaml",),
    ),
]


def make_inputs(root: Path) -> None:
    """The tiny model's folder, an Axolotl config and a memfit training YAML of it, and its data."""
    model = root / "fitreq_model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_TINY))
    (root / "fitreq_axolotl.yml").write_text(f"base_model: {model}\nadapter: lora\nsequence_len: 64\n")
    (root / "fitreq_data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    (root / "fitreq_memfit.yaml").write_text(
        f"model: {model}\ninit: random\ndata: {root / 'fitreq_data.jsonl'}\nmethod: lora\nseq_len: 64\nbatch_size: 2\n"
    )

"""Bad inputs of the exact plan's switch: --exact on memfit plan and fit, MEMFIT_EXACT, the page's ``exact``."""

from __future__ import annotations

import json
from pathlib import Path

from ._case import Case

#: The page's API, one request (exit 2 for a 4xx): ``{python} {bench}/_api_request.py METHOD URL``.
API = ("{python}", "{bench}/_api_request.py")


def api(line: str, **fields) -> Case:
    return Case(line, 2, prefix=API, **fields)


CASES: list[Case] = [
    Case("plan {d}/exact-tiny.json --seq-len 32 --exact", 0),
    Case("plan {d}/exact-tiny.json --seq-len 32 --full-sim", 0, says=("--full-sim is now --exact",)),
    Case("plan {d}/exact-tiny.json --seq-len 32 --exact=yes", 2, says=("--exact", "does not take a value")),
    Case(
        "plan {d}/exact-tiny.json --seq-len 32",
        2,
        env={"MEMFIT_EXACT": "maybe"},
        fast=True,
        says=("MEMFIT_EXACT='maybe': set it to 1 (or true, yes, on)",),
    ),
    Case(
        "fit {d}/exact-tiny.json --budget 1GiB --seq-len 32 --batch-size 2",
        2,
        env={"MEMFIT_EXACT": "2"},
        says=("MEMFIT_EXACT='2'",),
    ),
    Case("fit {d}/exact-tiny.json --budget 1GiB --seq-len 0 --exact", 2, says=("--seq-len: 0 must be 1 or more",)),
    Case("plan {d}/exact-tiny.json --seq-len 32 --exact --method lorra", 2, says=("--method",)),
    api("GET /api/plan?model=smollm2-135m&exact=maybe", says=("--exact: 'maybe' is not true or false",)),
    api("GET /api/fit?model=smollm2-135m&budget=1GiB&exact=2", says=("--exact: '2' is not true or false",)),
]


def make_inputs(root: Path) -> None:
    """The tiny model the cases plan (four layers: a plan with shortcuts would cut it)."""
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
    }
    (root / "exact-tiny.json").write_text(json.dumps(config))

"""Bad inputs of `memfit ui`'s JSON API (one request each, through benchmarks/_api_request.py: the
app in-process, exit 2 for a 4xx, 1 for a 500), and the command-line checks the API shares."""

from __future__ import annotations

import json
from pathlib import Path

from ._case import Case

#: The API, one request: ``{python} {bench}/_api_request.py METHOD URL [BODY_FILE]``.
API = ("{python}", "{bench}/_api_request.py")
LONG_NAME = "a" * 10_000
HUGE = "9" * 30
MANY_DIGITS = "9" * 5000


def api(line: str, **fields) -> Case:
    return Case(line, 2, prefix=API, **fields)


CASES: list[Case] = [
    # The command line: the checks the API shares.
    Case("plan smollm2-135m --context-bytes -1", 2, says=("--context-bytes: -1 must be 0 to",), fast=True),
    Case(f"plan smollm2-135m --context-bytes {HUGE}", 2, says=(f"--context-bytes: {HUGE} must be 0 to",)),
    Case("plan smollm2-135m --context-bytes lots", 2, says=("--context-bytes: 'lots' is not a whole number",)),
    Case(f"plan {LONG_NAME}", 2, says=("model: 'aaaa", "(10,000 characters) is longer than a model name")),
    Case(f"plan {'a' * 300}.yaml", 2, says=("the name is too long", "(305 characters)")),
    Case("plan smollm2-135m --seq-len ²", 2, says=("--seq-len: '²' is not a whole number",)),
    Case(f"plan smollm2-135m --rank {MANY_DIGITS}", 2, says=("--rank: '9999", "(5,000 characters) must be at most")),
    Case("plan smollm2-135m --targets 'q_proj v_proj'", 2, says=("--targets: 'q_proj v_proj': not a module name",)),
    Case("fit smollm2-135m --gpu rtx-4090 --seq-len 0", 2, says=("--seq-len: 0 must be 1 or more",)),
    # The API: every parameter checked as the command line checks it, a 4xx naming it.
    api("GET /api/plan?model=smollm2-135m&context_bytes=-1", says=("--context-bytes: -1 must be 0 to",), fast=True),
    api(f"GET /api/plan?model=smollm2-135m&context_bytes={HUGE}", says=(f"--context-bytes: {HUGE} must be 0 to",)),
    api(f"GET /api/plan?model={LONG_NAME}", says=("model: 'aaaa", "(10,000 characters) is longer than a model name")),
    api("GET /api/plan?seq_len=nan", says=("--seq-len: 'nan' is not a whole number",)),
    api(f"GET /api/plan?rank={MANY_DIGITS}", says=("--rank: '9999", "(5,000 characters)")),
    api("GET /api/plan?targets=q_proj%20v_proj", says=("not a module name",)),
    api("GET /api/context?context_bytes=-1", says=("--context-bytes: -1",)),
    api("GET /api/fit?model=smollm2-135m&gpu=rtx-4090&batch_size=-1", says=("--batch-size: -1 must be 1 or more",)),
    api("GET /api/fit?model=smollm2-135m&gpu=rtx-4090&seq_len=0&gpus=x", says=("--seq-len: 0", "--gpus: 'x'")),
    api("GET /api/export?command=plan&spec=%7Bnot", says=("spec: '{{not' is not valid JSON",)),
    api("GET /api/export?command=fit&rank=-1&method=lorra", says=("--rank: -1", "--method: 'lorra'")),
    api(f"GET /api/model?model={LONG_NAME}", says=("model: 'aaaa", "(10,000 characters)")),
    api(
        f"POST /api/model?filename={'x' * 300}.json {{d}}/ui-config.json", says=("file name 'xxxx", "(305 characters)")
    ),
]


def make_inputs(root: Path) -> None:
    """The config.json the API cases drop."""
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
    }
    (root / "ui-config.json").write_text(json.dumps(config))

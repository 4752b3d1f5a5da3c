"""Training data and the training YAML's types, through `memfit train CONFIG`: empty files streamed,
a split a Hub-layout folder lacks, columns a file lacks, pairs without a prompt or with one that
ends with an assistant turn, pairs mixed with other records, booleans and numbers taken for each
other, a Hub that cannot be reached. Each config stops before anything is trained."""

from __future__ import annotations

import json
from pathlib import Path

from ._case import Case

CLOSED_ENDPOINT = "http://127.0.0.1:9"  # the discard port: nothing listens there

USER = {"role": "user", "content": "What is 2 + 2?"}
GOOD = {"role": "assistant", "content": "2 + 2 = 4."}
BAD = {"role": "assistant", "content": "No idea."}

CASES = [
    Case(
        "train {d}/data_stream_empty_parquet.yaml",
        2,
        keeps=("data_empty.parquet",),
        says=("data: {d}/data_empty.parquet: no records (a Parquet file of 0 rows)",),
    ),
    Case("train {d}/data_stream_empty_jsonl.yaml", 2, says=("data: {d}/data_empty.jsonl: empty file (0 bytes)",)),
    Case(
        "train {d}/data_repo_split.yaml",
        2,
        says=("data: {d}/data_repo: no split 'validation'; its splits are train, test: set split: train",),
    ),
    Case(
        "train {d}/data_columns_sft.yaml",
        2,
        keeps=("data_chat.jsonl",),
        says=("columns: messages: no column 'conversation' in the file (its columns: messages)",),
    ),
    Case(
        "train {d}/data_columns_pairs.yaml",
        2,
        says=("columns: chosen: no column 'good' in the file (its columns: prompt, chosen, rejected)",),
    ),
    Case(
        "train {d}/data_pair_assistant_prompt.yaml",
        2,
        says=("data_pairs_assistant.jsonl, line 1: prompt: ends with an assistant message",),
    ),
    Case(
        "train {d}/data_pair_no_prompt.yaml",
        2,
        says=(
            "data_pairs_no_prompt.jsonl, line 1: prompt: missing, and chosen and rejected start with no text in common",
        ),
    ),
    Case(
        "train {d}/data_mix_kinds.yaml",
        2,
        says=(
            "data[0] ({d}/data_chat.jsonl) holds messages records",
            "data[1] ({d}/data_pairs.jsonl) holds preference pairs",
            "cannot be mixed in one objective",
        ),
    ),
    Case(
        "train {d}/data_streaming_text.yaml",
        2,
        fast=True,
        says=("streaming: 'yes' is not true or false but text: write streaming: true or streaming: false",),
    ),
    Case("train {d}/data_packing_text.yaml", 2, says=("packing: 'true' is not true or false but text",)),
    Case("train {d}/data_beta_true.yaml", 2, fast=True, says=("beta: true is true or false, not a number",)),
    Case(
        "train {d}/data_good.yaml --set beta=true --set objective=dpo",
        2,
        says=("beta: true is true or false, not a number",),
    ),
    Case(
        "train {d}/data_hub.yaml",
        2,
        env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": CLOSED_ENDPOINT, "HF_HOME": "{d}/data_hf_home"},
        says=(
            f"data: memfit-nobody/no-data: cannot reach the Hub at {CLOSED_ENDPOINT}",
            "HF_HUB_OFFLINE=1 (or HF_DATASETS_OFFLINE=1)",
            "or give a local path",
        ),
    ),
    Case(
        "train {d}/data_hub.yaml --set seed=1",
        2,
        env={"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "1", "HF_HOME": "{d}/data_hf_home"},
        says=("data: memfit-nobody/no-data: HF_DATASETS_OFFLINE=1 is set", "unset HF_DATASETS_OFFLINE"),
    ),
]


def make_inputs(root: Path) -> None:
    """The configs and data files the cases name (``data_`` before each name)."""
    import test_malformed_input as malformed  # tests/ is on the path bad_inputs.py sets

    data_line = f"data: {malformed.DEMO_DATA}\n"
    assert data_line in malformed.GOOD_YAML

    def config(name: str, data: str, extra: str = "") -> None:
        (root / name).write_text(malformed.GOOD_YAML.replace(data_line, f"data: {data}\n") + extra)

    _data_files(root)
    chat, pairs = root / "data_chat.jsonl", root / "data_pairs.jsonl"
    config("data_good.yaml", str(chat))
    config("data_stream_empty_parquet.yaml", str(root / "data_empty.parquet"), "streaming: true\n")
    config("data_stream_empty_jsonl.yaml", str(root / "data_empty.jsonl"), "streaming: true\n")
    config("data_repo_split.yaml", f"{{path: {root / 'data_repo'}, split: validation}}")
    config("data_columns_sft.yaml", f"{{path: {chat}, columns: {{messages: conversation}}}}")
    config(
        "data_columns_pairs.yaml", f"{{path: {pairs}, columns: {{chosen: good, rejected: bad}}}}", "objective: dpo\n"
    )
    config("data_pair_assistant_prompt.yaml", str(root / "data_pairs_assistant.jsonl"), "objective: dpo\n")
    config("data_pair_no_prompt.yaml", str(root / "data_pairs_no_prompt.jsonl"), "objective: dpo\n")
    config("data_mix_kinds.yaml", f"[{chat}, {pairs}]")
    config("data_streaming_text.yaml", str(chat), "streaming: 'yes'\n")
    config("data_packing_text.yaml", str(chat), "packing: 'true'\n")
    config("data_beta_true.yaml", str(pairs), "objective: dpo\nbeta: true\n")
    config("data_hub.yaml", "memfit-nobody/no-data")


def _data_files(root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def jsonl(name: str, rows: list) -> None:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))

    chat = [{"messages": [USER, GOOD]}] * 4
    jsonl("data_chat.jsonl", chat)
    jsonl("data_pairs.jsonl", [{"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}] * 4)
    jsonl("data_pairs_assistant.jsonl", [{"prompt": [USER, GOOD], "chosen": [GOOD], "rejected": [BAD]}])
    jsonl("data_pairs_no_prompt.jsonl", [{"chosen": "Yes, it is four.", "rejected": "No."}])
    jsonl("data_repo/data/train-00000-of-00001.jsonl", chat)
    jsonl("data_repo/data/test-00000-of-00001.jsonl", chat[:2])
    (root / "data_empty.jsonl").write_bytes(b"")
    pq.write_table(
        pa.table({"messages": pa.array([], pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))}),
        root / "data_empty.parquet",
    )

"""Commands given what a new user gives them: a list with an empty item, an output that is one of the
inputs (also through a link), a setting of memfit train given to plan or fit, a folder of the user's
as a run's output, a run folder without its adapter; and two that work (fit --write into a folder
that does not exist yet, a YAML config written to a .json file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ._case import Case

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}

#: run.json of a run stopped before it saved its adapter (what loading reads before any weight).
RUN_WITHOUT_ADAPTER = {
    "config": {"model": "smollm2-135m", "init": "random", "seed": 0},
    "spec": {"method": "lora"},
    "model_config": TINY,
    "status": "interrupted",
    "step": 2,
    "total_steps": 4,
}

CASES = [
    # An empty item in a list is a slip of the keyboard, never "no module"
    Case(
        "plan {d}/cmd_tiny.json --modules-to-save ,,", 2, fast=True, says=("--modules-to-save: ',,' has an empty item",)
    ),
    Case("plan {d}/cmd_tiny.json --targets q_proj,,v_proj", 2, says=("--targets: 'q_proj,,v_proj' has an empty item",)),
    Case("plan {d}/cmd_tiny.json --targets ,", 2, says=("--targets: ',' has an empty item",)),
    # A knob of the hf recipe given to memfit's own step
    Case("plan {d}/cmd_tiny.json --use-reentrant on", 2, says=("--use-reentrant on is a choice of the hf recipe",)),
    Case(
        "plan {d}/cmd_tiny.json --adapter-dtype compute",
        2,
        says=("--adapter-dtype compute is a choice of the hf recipe's adapters",),
    ),
    Case(
        "plan {d}/cmd_tiny.json --recipe hf --method full --adapter-dtype compute",
        2,
        says=("--adapter-dtype compute is a choice of the hf recipe's adapters",),
    ),
    Case("fit {d}/cmd_tiny.json --budget 4GiB --modules-to-save lm_head,", 2, says=("--modules-to-save: 'lm_head,'",)),
    Case("train {d}/good.yaml --report-to tensorboard,,wandb", 2, says=("report_to", "has an empty name")),
    # An output is never an input, --overwrite or not
    Case(
        "generate {d}/cmd_run --prompts {d}/cmd_prompts.jsonl --out {d}/cmd_prompts.jsonl --overwrite",
        2,
        fast=True,
        says=("--out", "is the --prompts file", "memfit never writes over its inputs"),
        keeps=("cmd_prompts.jsonl",),
    ),
    Case(
        "generate {d}/cmd_run --prompts {d}/cmd_prompts.jsonl --out {d}/cmd_prompts_link.jsonl --overwrite",
        2,
        says=("is the --prompts file",),
        keeps=("cmd_prompts.jsonl",),
    ),
    Case(
        "generate {d}/cmd_run --prompts {d}/cmd_prompts.jsonl --out {d}/cmd_prompts_hard.jsonl --overwrite",
        2,
        says=("is the --prompts file",),
        keeps=("cmd_prompts.jsonl",),
    ),
    Case(
        "fit {d}/cmd_axolotl.yml --budget 4GiB --write {d}/cmd_axolotl.yml --overwrite",
        2,
        says=("--write", "is the config being fitted"),
        keeps=("cmd_axolotl.yml",),
    ),
    Case(
        "fit {d}/cmd_tiny.json --budget 4GiB --write {d}/cmd_tiny.json --overwrite",
        2,
        says=("is the config being fitted",),
        keeps=("cmd_tiny.json",),
    ),
    Case(
        "fit {d}/cmd_tiny.json --budget 4GiB --data {d}/cmd_data.jsonl --write {d}/cmd_data.jsonl --overwrite",
        2,
        says=("is the --data file",),
        keeps=("cmd_data.jsonl",),
    ),
    Case(
        "merge --base {d}/base --adapter {d}/adapter --out {d}/base --overwrite",
        2,
        says=("--out", "is the --base folder"),
        keeps=("base",),
    ),
    Case("report {d}/run_ok --out {d}/run_ok/run.json", 2, says=("is the run's run.json",), keeps=("run_ok",)),
    Case("train {d}/good.yaml -o {d}/good.yaml", 2, says=("output_dir", "is the config file"), keeps=("good.yaml",)),
    # fit --write: checked before the search, and no temporary name in any message
    Case(
        "fit {d}/cmd_tiny.json --budget 4GiB --data {d}/cmd_missing.jsonl --write {d}/cmd_best.yaml",
        2,
        says=("--data", "does not exist"),
    ),
    # memfit train's settings given to plan or fit: what they are, not "no such option"
    Case(
        "plan {d}/cmd_tiny.json --simpo-gamma 0.2",
        2,
        fast=True,
        says=("--simpo-gamma 0.2", "training-config field", "does not change memory", "Drop --simpo-gamma"),
    ),
    Case("plan {d}/cmd_tiny.json --lr 1e-4 --resume", 2, says=("--lr 1e-4", "--resume: an option of memfit train")),
    Case(
        "fit {d}/cmd_tiny.json --budget 4GiB --warmup-steps 10",
        2,
        says=("--warmup-steps 10", "memfit fit does not take it"),
    ),
    Case(
        "plan {d}/cmd_tiny.json --data {d}/cmd_data.jsonl",
        2,
        says=("--data", "the sequence length planned is --seq-len"),
    ),
    # A folder of the user's is not a run to resume
    Case(
        "train {d}/good.yaml -o {d}/cmd_users_folder",
        2,
        says=("is not a memfit run folder", "will not write into it"),
        keeps=("cmd_users_folder",),
    ),
    # A run folder without its adapter: what it lacks, and what to do (a resume only with a checkpoint)
    Case("chat {d}/cmd_run", 2, says=("has no adapter saved yet", "it saved no checkpoint to resume from")),
    Case(
        "generate {d}/cmd_run --prompts {d}/cmd_prompts.jsonl --out {d}/cmd_replies.jsonl",
        2,
        says=("has no adapter saved yet",),
        keeps=("cmd_prompts.jsonl",),
    ),
    # These work: a folder that does not exist yet is made, a .json name gets JSON
    Case("fit {d}/cmd_axolotl.yml --budget 4GiB --write {d}/cmd_new/fitted.json", 0, keeps=("cmd_axolotl.yml",)),
]


def make_inputs(root: Path) -> None:
    """The files the cases above name, each prefixed ``cmd_``."""
    (root / "cmd_tiny.json").write_text(json.dumps(TINY))
    model = root / "cmd_model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    (root / "cmd_axolotl.yml").write_text(
        f"base_model: {model}   # mine\nadapter: lora\nsequence_len: 64\nbf16: false\n"
    )
    (root / "cmd_data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    prompts = root / "cmd_prompts.jsonl"
    prompts.write_text('"Hello"\n{"prompt": "Name a color.", "id": 7}\n')
    (root / "cmd_prompts_link.jsonl").symlink_to(prompts)
    os.link(prompts, root / "cmd_prompts_hard.jsonl")
    users = root / "cmd_users_folder"
    users.mkdir()
    (users / "notes.txt").write_text("mine\n")
    run = root / "cmd_run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(RUN_WITHOUT_ADAPTER))

"""Preference objectives on several GPUs: what is refused (in the words the user wrote: a config's
keys, a training YAML's fields, the command line's flags), and what plans and trains now (exit 0)."""

from __future__ import annotations

import json
from pathlib import Path

from ._case import Case

#: The prefix of every file these cases name.
_P = "prefgpus"


def _train_yaml(root: Path, **fields) -> str:
    """A DPO training YAML of the tiny model on the files' own pairs, with ``fields`` set."""
    settings = {
        "model": "smollm2-135m",
        "init": "random",
        "data": str(root / f"{_P}-pairs.jsonl"),
        "objective": "dpo",
        "method": "lora",
        "precision": "fp32",
        "seq_len": 64,
        "batch_size": 2,
        "max_steps": 1,
        "device": "cpu",
        "output_dir": str(root / f"{_P}-run"),
        **fields,
    }
    return "".join(f"{key}: {json.dumps(value)}\n" for key, value in settings.items())


def make_inputs(root: Path) -> None:
    """The configs the cases name: LLaMA-Factory and Axolotl DPO configs with DeepSpeed and FSDP,
    memfit training YAMLs of DPO on two GPUs, and their pairs."""
    pair = {"prompt": "Q: 2 + 2?\nA:", "chosen": " 4.", "rejected": " 5."}
    files = {
        f"{_P}-pairs.jsonl": "".join(json.dumps(pair) + "\n" for _ in range(8)),
        f"{_P}-ds3.json": json.dumps({"zero_optimization": {"stage": 3}}),
        f"{_P}-ds3-offload.json": json.dumps(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "cpu"},
                    "offload_optimizer": {"device": "cpu"},
                }
            }
        ),
        f"{_P}-lf-dpo.yaml": (
            f"model_name_or_path: smollm2-135m\nstage: dpo\nfinetuning_type: full\ncutoff_len: 128\n"
            f"per_device_train_batch_size: 1\nbf16: true\ndeepspeed: {_P}-ds3.json\n"
        ),
        f"{_P}-lf-offload.yaml": (
            f"model_name_or_path: smollm2-135m\nstage: dpo\nfinetuning_type: lora\ncutoff_len: 128\n"
            f"optim: adamw_bnb_8bit\ndeepspeed: {_P}-ds3-offload.json\n"
        ),
        f"{_P}-axolotl-offload.yaml": (
            "base_model: smollm2-135m\nrl: dpo\nadapter: lora\nlora_r: 8\nlora_target_linear: true\n"
            "sequence_len: 128\nmicro_batch_size: 1\noptimizer: adamw_bnb_8bit\nfsdp_version: 2\n"
            "fsdp_config:\n  offload_params: true\n"
        ),
        f"{_P}-zero1.yaml": _train_yaml(root, gpus=2, shard="zero1"),
        f"{_P}-noshard.yaml": _train_yaml(root, gpus=2),
        f"{_P}-fp16.yaml": _train_yaml(root, gpus=2, shard="fsdp", precision="fp16"),
        f"{_P}-fsdp.yaml": _train_yaml(root, gpus=2, shard="fsdp"),
    }
    for name, text in files.items():
        (root / name).write_text(text)


CASES = [
    # plan: an 8-bit optimizer cannot run with the optimizer step on the host: named by the config's keys
    Case(
        f"plan {{d}}/{_P}-lf-offload.yaml --gpus 2",
        2,
        fast=True,
        says=("deepspeed (memfit shard: fsdp-offload)", "optim (memfit optimizer: adamw8bit)", "--optimizer adamw"),
        keeps=(f"{_P}-lf-offload.yaml", f"{_P}-ds3-offload.json"),
    ),
    Case(
        f"plan {{d}}/{_P}-axolotl-offload.yaml --gpus 2",
        2,
        says=("fsdp_config, fsdp_version (memfit shard: fsdp-offload)", "optimizer (memfit optimizer: adamw8bit)"),
        keeps=(f"{_P}-axolotl-offload.yaml",),
    ),
    Case(
        f"plan {{d}}/{_P}-lf-offload.yaml --gpus 2 --optimizer paged-adamw8bit",
        2,
        says=("deepspeed (memfit shard: fsdp-offload) with --optimizer paged-adamw8bit",),
    ),
    Case(
        "plan smollm2-135m --objective dpo --gpus 2 --shard fsdp-offload --optimizer adamw8bit",
        2,
        says=("--shard fsdp-offload with --optimizer adamw8bit",),
    ),
    # plan and fit: a preference run on several GPUs is planned per GPU (it was refused before)
    Case(f"plan {{d}}/{_P}-lf-dpo.yaml --gpus 2", 0, keeps=(f"{_P}-lf-dpo.yaml", f"{_P}-ds3.json")),
    Case("plan smollm2-135m --objective dpo --method full --gpus 2 --shard fsdp --seq-len 128", 0),
    # train: what memfit train cannot do on several processes, named as the YAML's fields
    Case(
        f"train {{d}}/{_P}-zero1.yaml", 2, fast=True, says=("shard: 'zero1'", "use zero2"), keeps=(f"{_P}-zero1.yaml",)
    ),
    Case(f"train {{d}}/{_P}-noshard.yaml", 2, says=("shard: 'none' with gpus: 2", "shard: fsdp")),
    Case(f"train {{d}}/{_P}-fp16.yaml", 2, says=("precision: 'fp16' with gpus: 2", "precision: bf16")),
    Case(
        f"train {{d}}/{_P}-fsdp.yaml",
        2,
        says=("gpus: 2, but this is a single process", "--nproc 2"),
        keeps=(f"{_P}-fsdp.yaml", f"{_P}-run"),
    ),
    Case(
        f"train {{d}}/{_P}-fsdp.yaml --nproc 4",
        2,
        says=("--nproc 4, but the config says gpus: 2",),
        keeps=(f"{_P}-run",),
    ),
]

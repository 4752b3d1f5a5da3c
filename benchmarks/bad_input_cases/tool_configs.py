"""Bad inputs of `memfit plan CONFIG` / `memfit fit CONFIG`: values another tool would refuse, a DeepSpeed
key naming a folder, `--model`, a PEFT adapter named as the model, and memfit's own training YAML."""

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
    # A value the tool would refuse: one line naming the key, the value, the tool and the closest value it takes.
    Case(
        "plan {d}/toolcfg_axolotl_rl.yml",
        2,
        fast=True,
        says=("rl: 'dpoo' is not an RL trainer Axolotl knows", "Did you mean 'dpo'?"),
    ),
    Case("plan {d}/toolcfg_axolotl_scheduler.yml", 2, says=("lr_scheduler: 'cosin'", "Did you mean 'cosine'?")),
    Case(
        "plan {d}/toolcfg_lf_pref_loss.yaml",
        2,
        says=("pref_loss: 'unknownloss' is not a pref_loss LLaMA-Factory knows", "Did you mean 'orpo'?"),
    ),
    Case(
        "plan {d}/toolcfg_lf_stage.yaml",
        2,
        says=("stage: 'sftt' is not a stage LLaMA-Factory knows", "Did you mean 'sft'?"),
    ),
    Case("plan {d}/toolcfg_lf_flash_attn.yaml", 2, says=("flash_attn: 'flash_attention_2'", "LLaMA-Factory")),
    Case(
        "fit {d}/toolcfg_trl_loss_type.yaml --gpu rtx-4090",
        2,
        fast=True,
        says=("loss_type: 'bogus' is not a loss_type TRL's", "Did you mean"),
    ),
    Case(
        "plan {d}/toolcfg_trl_dpo_loss.yaml", 2, says=("loss_type: 'simpo' is not a loss_type TRL's DPOConfig takes",)
    ),
    Case("plan {d}/toolcfg_trl_packing.yaml", 2, says=("packing_strategy: 'ffd'", "Did you mean 'bfd'?")),
    Case("plan {d}/toolcfg_trl_scheduler.yaml", 2, says=("lr_scheduler_type: 'cosin'", "the Trainer")),
    # The checkpointing variant: a word that is not true or false, a string where a mapping belongs.
    Case(
        "plan {d}/toolcfg_axolotl_reentrant.yml",
        2,
        says=("gradient_checkpointing_kwargs: use_reentrant: 'sometimes' is not true or false",),
    ),
    Case(
        "plan {d}/toolcfg_trl_gc_kwargs.yaml", 2, says=("gradient_checkpointing_kwargs: 'reentrant' is not a mapping",)
    ),
    Case(
        "plan {d}/toolcfg_axolotl_autocast.yml",
        2,
        says=("peft_autocast_adapter_dtype: 'sometimes' is not true or false",),
    ),
    # deepspeed: a folder where a JSON file belongs.
    Case(
        "plan {d}/toolcfg_ds_folder.yaml",
        2,
        says=("deepspeed: 'toolcfg_ds' is a folder", "a DeepSpeed JSON file is expected"),
    ),
    # --model: a model that is not there; beside a model instead of a config.
    Case("plan {d}/toolcfg_trl.yaml --model {d}/toolcfg_no_model", 2, says=("toolcfg_no_model' does not exist",)),
    Case("plan smollm2-135m --model {d}/toolcfg_model", 2, says=("--model: replaces the model of a training config",)),
    Case("fit llama-3.1-8b --gpu rtx-4090 --model {d}/toolcfg_model", 2, says=("--model: replaces the model",)),
    # A PEFT adapter named as the model: one without a base, one whose adapter_config.json is not JSON.
    Case("plan {d}/toolcfg_orphan.yaml", 2, says=("is a PEFT adapter", "names no base_model_name_or_path")),
    Case(
        "plan {d}/toolcfg_broken_adapter.yaml",
        2,
        says=("adapter_config.json", "cannot be read as a PEFT adapter's config"),
    ),
    # memfit's own training YAML: the trainer's errors, and --write onto it refused before any search.
    Case("plan {d}/toolcfg_memfit_typo.yaml", 2, says=("batch_sise: unknown setting. Did you mean 'batch_size'?",)),
    Case("plan {d}/toolcfg_memfit_no_data.yaml", 2, says=("data: required",)),
    Case(
        "fit {d}/toolcfg_memfit.yaml --budget 2GiB --write {d}/toolcfg_memfit.yaml",
        2,
        fast=True,
        says=("is the config being fitted",),
        keeps=("toolcfg_memfit.yaml",),
    ),
    Case("fit {d}/toolcfg_memfit.yaml --budget 2GiB --batch-size 0", 2, says=("--batch-size: 0 must be 1 or more",)),
    Case("fit {d}/toolcfg_trl.yaml --budget 2GiB --batch-size 0", 2, says=("--batch-size: 0 must be 1 or more",)),
    Case("plan {d}/toolcfg_trl.yaml --gpus x", 2, says=("--gpus: 'x' is not a whole number",)),
    Case("fit {d}/toolcfg_trl.yaml --budget 2GiB --gpus x", 2, says=("--gpus: 'x' is not a whole number",)),
]


def make_inputs(root: Path) -> None:
    """The configs, the tiny model folder, the adapter folders and the DeepSpeed folder the cases name."""
    model = root / "toolcfg_model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_TINY))
    (root / "toolcfg_ds").mkdir()
    (root / "toolcfg_ds" / "ds_z3.json").write_text('{"zero_optimization": {"stage": 3}}')
    orphan, broken = root / "toolcfg_orphan_adapter", root / "toolcfg_broken_adapter"
    orphan.mkdir(), broken.mkdir()
    (orphan / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8,')
    axolotl, lf, trl = (
        f"base_model: {model}\nadapter: lora\n",
        f"model_name_or_path: {model}\n",
        f"model_name_or_path: {model}\nuse_peft: true\n",
    )
    memfit = (
        f"model: {model}\ninit: random\ndata: {root / 'toolcfg_data.jsonl'}\nmethod: lora\nseq_len: 64\nbatch_size: 2\n"
    )
    files = {
        "toolcfg_axolotl_rl.yml": axolotl + "rl: dpoo\n",
        "toolcfg_axolotl_scheduler.yml": axolotl + "lr_scheduler: cosin\n",
        "toolcfg_lf_pref_loss.yaml": lf + "stage: dpo\npref_loss: unknownloss\n",
        "toolcfg_lf_stage.yaml": lf + "stage: sftt\n",
        "toolcfg_lf_flash_attn.yaml": lf + "flash_attn: flash_attention_2\n",
        "toolcfg_trl_loss_type.yaml": trl + "loss_type: bogus\n",
        "toolcfg_trl_dpo_loss.yaml": trl + "beta: 0.1\nprecompute_ref_log_probs: true\nloss_type: [sigmoid, simpo]\n",
        "toolcfg_trl_packing.yaml": trl + "packing: true\npacking_strategy: ffd\n",
        "toolcfg_trl_scheduler.yaml": trl + "lr_scheduler_type: cosin\n",
        "toolcfg_axolotl_reentrant.yml": axolotl
        + "gradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: sometimes}\n",
        "toolcfg_trl_gc_kwargs.yaml": trl + "gradient_checkpointing_kwargs: reentrant\n",
        "toolcfg_axolotl_autocast.yml": axolotl + "peft_autocast_adapter_dtype: sometimes\n",
        "toolcfg_ds_folder.yaml": lf + "finetuning_type: full\ndeepspeed: toolcfg_ds\n",
        "toolcfg_trl.yaml": trl,
        "toolcfg_orphan.yaml": f"model_name_or_path: {orphan}\nuse_peft: true\n",
        "toolcfg_broken_adapter.yaml": f"model_name_or_path: {broken}\nuse_peft: true\n",
        "toolcfg_memfit.yaml": memfit,
        "toolcfg_memfit_typo.yaml": memfit + "batch_sise: 4\n",
        "toolcfg_memfit_no_data.yaml": f"model: {model}\ninit: random\nmethod: lora\n",
        "toolcfg_data.jsonl": '{"instruction": "hi", "output": "hello"}\n',
    }
    for name, text in files.items():
        (root / name).write_text(text)

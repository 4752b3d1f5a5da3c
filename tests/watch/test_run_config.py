"""The configuration rows of memfit report: from memfit train's run.json, a Trainer's settings, or a spec."""

from __future__ import annotations

from pathlib import Path

from watch_helpers import start_record

from memfit.watch.run_config import configuration_rows, format_value
from memfit.watch.timeline import RunFolder, Timeline


def folder(run=None, **start) -> RunFolder:
    return RunFolder(path=Path("run"), timeline=Timeline(start=start_record(**start), steps=[]), metrics=[], run=run)


TRAIN_CONFIG = {
    "model": "smollm2-135m",
    "init": "random",
    "model_overrides": {"num_hidden_layers": 2},
    "method": "full",
    "rank": 16,
    "alpha": None,
    "precision": "bf16",
    "batch_size": 8,
    "seq_len": 1024,
    "grad_accum": 4,
    "checkpointing": "on",
    "lr": 1e-5,
    "schedule": "constant",
    "epochs": 2.0,
    "max_steps": None,
    "data": ["a.jsonl", "b.jsonl"],
    "data_format": "sharegpt",
    "eval_split": 0.0,
    "eval_data": "eval.jsonl",
    "eval_every": 0,
    "seed": 0,
    "device": "cuda:1",
}


def test_memfit_train_rows_in_order_without_adapter_knobs_for_full_fine_tuning():
    spec = {
        "method": "full",
        "rank": 16,
        "alpha": 32.0,
        "targets": ["all-linear"],
        "precision": "bf16",
        "batch_size": 4,
        "seq_len": 1024,
        "grad_accum": 8,
        "checkpointing": "on",
        "tiling": "auto",
        "packing": True,
    }
    change = {
        "step": 57,
        "reason": "out of memory",
        "from": {"batch_size": 4, "grad_accum": 8},
        "to": {"batch_size": 2, "grad_accum": 16},
    }
    rows = configuration_rows(
        folder(
            {
                "config": TRAIN_CONFIG,
                "spec": spec,
                "total_steps": 500,
                "config_changes": [change],
                "fit": {"given": {"batch_size": 8, "grad_accum": 4, "checkpointing": "on"}},
            }
        )
    )
    assert [name for name, _ in rows] == [
        "model",
        "method",
        "precision",
        "batch_size",
        "grad_accum",
        "seq_len",
        "checkpointing",
        "other knobs",
        "lr",
        "schedule",
        "epochs",
        "data",
        "eval",
        "seed",
        "device",
        "fit: auto chose",
        "from step 57",
    ]
    values = dict(rows)
    assert values["model"] == "smollm2-135m (random weights; overrides: num_hidden_layers=2)"
    assert values["batch_size"] == "4" and values["other knobs"] == "tiling auto, packing on"
    assert (
        values["lr"] == "1e-05" and values["schedule"] == "constant" and values["epochs"] == "2 (500 optimizer steps)"
    )
    assert values["data"] == "a.jsonl, b.jsonl (sharegpt)" and values["eval"] == "eval.jsonl, at the end"
    assert values["fit: auto chose"] == "batch_size 4 (given 8), grad_accum 8 (given 4), checkpointing on"
    assert values["from step 57"] == "out of memory: batch_size 4 -> 2, grad_accum 8 -> 16"


def test_a_trainers_settings_keep_their_names_and_a_spec_alone_is_shown():
    rows = configuration_rows(
        folder(config={"model": "org/m", "r": 16, "target_modules": ["q_proj", "v_proj"], "bf16": True})
    )
    assert rows == [("model", "org/m"), ("r", "16"), ("target_modules", "q_proj, v_proj"), ("bf16", "on")]
    assert configuration_rows(folder(spec={"method": "lora", "checkpointing": "off"})) == [
        ("method", "lora"),
        ("checkpointing", "off"),
    ]
    assert configuration_rows(folder()) == []


def test_values_read_as_people_write_them():
    assert [format_value(v) for v in (True, 2e-4, 0.05, 134_515_008, 512, ("a", "b"), None)] == [
        "on",
        "0.0002",
        "0.05",
        "134,515,008",
        "512",
        "a, b",
        "None",
    ]

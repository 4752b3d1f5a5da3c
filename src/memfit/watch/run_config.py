"""The configuration a run trained with, as rows for ``memfit report``: pure functions over a run folder.

Three sources, the fullest first: memfit train's ``run.json`` (the resolved config, the knobs, the
model's size, what ``fit: auto`` chose and what changed after running out of memory); the
``config`` a :class:`~memfit.watch.MemoryCallback` records from the ``Trainer`` (its own names:
``learning_rate``, ``per_device_train_batch_size``, PEFT's ``r``...); the knobs any recorder was
given (``spec``).
"""

from __future__ import annotations

from typing import Any

from memfit.watch.timeline import RunFolder

#: Why a run folder shows no configuration.
NO_CONFIGURATION = (
    "no configuration was recorded: there is no run.json (memfit train writes one) and the recorder was "
    "given none (MemoryCallback records the Trainer's settings; MemoryRecorder takes spec=)"
)

#: The knobs shown one per row, in this order (the others share a row).
HEADLINE_KNOBS = (
    "method",
    "rank",
    "alpha",
    "dropout",
    "targets",
    "precision",
    "optimizer",
    "batch_size",
    "grad_accum",
    "seq_len",
    "checkpointing",
)
#: Knobs that only mean something with adapters.
ADAPTER_KNOBS = ("rank", "alpha", "dropout", "targets")


def configuration_rows(run: RunFolder) -> list[tuple[str, str]]:
    """(name, value) rows of the run's configuration; empty when none was recorded."""
    if isinstance((run.run or {}).get("config"), dict):
        return _memfit_train_rows(run.run)
    recorded = run.timeline.start.get("config")
    if isinstance(recorded, dict) and recorded:
        return [(str(k), format_value(v)) for k, v in recorded.items() if v is not None]
    spec = run.timeline.start.get("spec")
    if isinstance(spec, dict) and spec:
        return [(str(k), format_value(v)) for k, v in spec.items() if v is not None]
    return []


def format_value(value: Any) -> str:
    """A setting as the page shows it: on/off, 0.0002 as ``2e-04``... lists joined by commas."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={format_value(v)}" for k, v in value.items())
    return str(value)


def _memfit_train_rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    from memfit.spec import ADAPTER_METHODS

    config = record["config"]
    spec = record.get("spec") if isinstance(record.get("spec"), dict) else {}
    knobs = {**{k: config.get(k) for k in HEADLINE_KNOBS if k in config}, **spec}
    adapters = knobs.get("method") in ADAPTER_METHODS
    rows = [("model", _model_text(config))]
    setup = record.get("setup") if isinstance(record.get("setup"), dict) else {}
    if isinstance(setup.get("total_params"), int):
        trainable = setup.get("trainable_params")
        share = (
            f", {setup['trainable_percent']:.2f}%" if isinstance(setup.get("trainable_percent"), (int, float)) else ""
        )
        rows.append(
            (
                "parameters",
                f"{setup['total_params']:,}"
                + (f" ({trainable:,} trainable{share})" if isinstance(trainable, int) else ""),
            )
        )
    for name in HEADLINE_KNOBS:
        if name in knobs and knobs[name] is not None and (adapters or name not in ADAPTER_KNOBS):
            rows.append((name, format_value(knobs[name])))
    rest = [f"{k} {format_value(v)}" for k, v in knobs.items() if k not in HEADLINE_KNOBS and v is not None]
    if rest:
        rows.append(("other knobs", ", ".join(rest)))
    rows += _schedule_rows(config, record.get("total_steps"))
    rows += _data_rows(config)
    rows += [(name, format_value(config[name])) for name in ("seed", "device") if config.get(name) is not None]
    rows += _fit_rows(record, spec)
    versions = record.get("versions")
    if isinstance(versions, dict) and versions:
        rows.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
    return rows


def _model_text(config: dict[str, Any]) -> str:
    text = str(config.get("model", "?"))
    notes = []
    if config.get("revision") not in (None, "main"):
        notes.append(f"revision {config['revision']}")
    if config.get("init") == "random":
        notes.append("random weights")
    if config.get("model_overrides"):
        notes.append("overrides: " + format_value(config["model_overrides"]))
    return text + (f" ({'; '.join(notes)})" if notes else "")


def _schedule_rows(config: dict[str, Any], total_steps: Any) -> list[tuple[str, str]]:
    rows = []
    if config.get("lr") is not None:
        rows.append(("lr", format_value(config["lr"])))
    schedule = str(config.get("schedule", "?"))
    if config.get("warmup_steps"):
        schedule += f", warmup {config['warmup_steps']} steps"
    elif config.get("warmup_ratio"):
        schedule += f", warmup {format_value(config['warmup_ratio'])} of the steps"
    if config.get("schedule") in ("cosine", "linear"):
        schedule += f", down to {format_value(float(config.get('min_lr_ratio') or 0.0))} x lr"
    rows.append(("schedule", schedule))
    for name in ("weight_decay", "max_grad_norm"):
        if config.get(name) is not None:
            rows.append((name, format_value(config[name])))
    if config.get("max_steps"):
        rows.append(("max_steps", format_value(config["max_steps"])))
    else:
        steps = f" ({total_steps:,} optimizer steps)" if isinstance(total_steps, int) else ""
        rows.append(("epochs", format_value(config.get("epochs") or 1.0) + steps))
    return rows


def _data_rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if config.get("data"):
        fmt = config.get("data_format")
        rows.append(("data", format_value(config["data"]) + (f" ({fmt})" if fmt and fmt != "auto" else "")))
    every = f", every {config['eval_every']} steps" if config.get("eval_every") else ", at the end"
    if config.get("eval_data"):
        rows.append(("eval", format_value(config["eval_data"]) + every))
    elif config.get("eval_split"):
        rows.append(("eval", f"{config['eval_split']:.0%} of the data held out{every}"))
    else:
        rows.append(("eval", "none"))
    return rows


def _fit_rows(record: dict[str, Any], spec: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    fit = record.get("fit")
    if isinstance(fit, dict) and isinstance(fit.get("given"), dict):
        chosen = [
            f"{k} {format_value(spec.get(k))}" + ("" if spec.get(k) == v else f" (given {format_value(v)})")
            for k, v in fit["given"].items()
            if k in spec
        ]
        rows.append(("fit: auto chose", ", ".join(chosen)))
    for change in record.get("config_changes") or []:
        if not isinstance(change, dict):
            continue
        before, after = change.get("from") or {}, change.get("to") or {}
        moved = [
            f"{k} {format_value(before.get(k))} -> {format_value(v)}" for k, v in after.items() if before.get(k) != v
        ]
        rows.append(
            (
                f"from step {change.get('step', '?')}",
                f"{change.get('reason', 'changed')}: " + (", ".join(moved) or "same knobs"),
            )
        )
    return rows

"""What a plan of another tool's config says about the config, in lines for people.

The plan's ``details.config`` (:meth:`memfit.interop.reading.ToolConfig.to_json`) holds it all;
these lines are what ``memfit plan CONFIG`` and ``memfit fit CONFIG`` print: which tool's config
was read, then every key not modelled (its effect is not in the plan), every approximation, and
the unknown keys, each once.
"""

from __future__ import annotations

from typing import Any


def headline(config: dict[str, Any]) -> str:
    """``read Axolotl config qlora.yml: model llama-3.2-1b, planned as the Hugging Face step``."""
    if config.get("tool") == "memfit":
        return _own_headline(config)
    step = (
        "memfit's step (recipe memfit, as for grpo)"
        if (config.get("knobs") or {}).get("recipe") == "memfit"
        else "the tool's Hugging Face step (recipe hf)"
    )
    return (
        f"read {config['title']} config {config['path']}: model {config['model']}{model_origin(config)}, planned as "
        f"{step}"
        + (
            f", DeepSpeed ZeRO stage {config['deepspeed']['stage']} from {config['deepspeed']['path']}"
            if config.get("deepspeed")
            else ""
        )
    )


def _own_headline(config: dict[str, Any]) -> str:
    """``read memfit training config tiny.yaml: model smollm2-135m (model_overrides: ...), planned as
    memfit train plans it before loading``."""
    overrides = config.get("model_overrides") or {}
    names = list(overrides)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    changed = f" with model_overrides ({shown})" if overrides else ""
    return (
        f"read memfit training config {config['path']}: model {config['model']}{model_origin(config)}{changed}, planned "
        "as `memfit train` plans it before loading"
    )


def data_line(config: dict[str, Any]) -> str | None:
    """The length a memfit training config was planned at: the data's, or seq_len and why."""
    data = config.get("data")
    if not data:
        return None
    if data["read"]:
        return (
            f"data: {data['examples']:,} training examples read; planned at {data['planned_as']}, "
            f"{data['planned_seq_len']:,} tokens a sequence (seq_len {data['seq_len']:,})"
        )
    return f"data: not read ({data['why_not']}): planned at seq_len {data['seq_len']:,}"


def model_origin(config: dict[str, Any]) -> str:
    """Where the planned model came from, when not from the config's model key as written: ``--model``
    in place of the config's, the base of a PEFT adapter."""
    parts = []
    if config.get("given_model"):
        replaced = config.get("replaced")
        parts.append(f"--model, in place of the config's {replaced}" if replaced else "--model")
    adapter = config.get("adapter")
    if adapter:
        parts.append(f"the base of the PEFT adapter {adapter['name']}")
    return f" ({'; '.join(parts)})" if parts else ""


def adapter_line(config: dict[str, Any]) -> str | None:
    """What a PEFT adapter named as the model was planned as, or None."""
    adapter = config.get("adapter")
    if not adapter:
        return None
    settings = ", ".join(f"{k} {_short(v)}" for k, v in adapter["settings"].items() if k in adapter["taken"])
    taken = (
        f"its settings as the method where the config names none: {settings}"
        if settings
        else ("the config's own method (it names every setting)")
    )
    return (
        f"adapter: {adapter['name']} is a PEFT adapter (adapter_config.json), which transformers loads as its base "
        f"{adapter['base']} with the adapter on it: planned as {adapter['base']}, with {taken}"
    )


def _short(value: Any) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


def detail_lines(config: dict[str, Any]) -> list[str]:
    """The adapter named as the model, one line per key not modelled, per approximation, and one for
    the unknown keys."""
    lines = [line for line in (data_line(config), adapter_line(config)) if line]
    for item in config.get("not_modelled", []):
        lines.append(f"not modelled: {item['key']}{_value(item['value'])}: {item['why']}")
    for item in config.get("approximated", []):
        lines.append(f"approximated: {item['key']}{_value(item['value'])}: {item['why']}")
    unknown = config.get("unknown_keys") or []
    if unknown:
        lines.append(f"unknown key{'s' if len(unknown) > 1 else ''}, ignored: {', '.join(unknown)}")
    return lines


def _value(value: Any) -> str:
    if value is None or value == {}:
        return ""
    text = str(value)
    return f" ({text})" if len(text) <= 60 else f" ({text[:57]}...)"

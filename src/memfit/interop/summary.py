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
    return (f"read {config['title']} config {config['path']}: model {config['model']}, planned as the tool's Hugging Face "
            "step (recipe hf)" + (f", DeepSpeed ZeRO stage {config['deepspeed']['stage']} from {config['deepspeed']['path']}"
                                  if config.get("deepspeed") else ""))


def detail_lines(config: dict[str, Any]) -> list[str]:
    """One line per key not modelled, per approximation, and one for the unknown keys."""
    lines = []
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

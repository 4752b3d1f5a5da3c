"""grpo's reward functions: Python callables as TRL's GRPOTrainer takes them.

A reward function is called as TRL calls one: ``f(prompts=..., completions=..., completion_ids=...,
**columns) -> list[float]``, one reward per completion (None: not scored by this function), where
``columns`` are the dataset's other fields, one value per completion. A completion is text, or for
a prompt of messages a list of one assistant message (``[{"role": "assistant", "content": ...}]``).

A training config names them in ``reward_funcs`` (TRL's name), each one of:

- ``path/to/file.py:function`` (relative to the config's folder);
- ``package.module:function`` (an importable module);
- a built-in name (:data:`BUILTINS`): ``think_format`` (TRL's ``think_format_reward``: 1 for a
  completion that opens with one ``<think>...</think>`` block, else 0) or ``length`` (1 at the
  ``target_length`` column's length in characters, or :data:`DEFAULT_TARGET_CHARS`, falling
  linearly to 0 at twice or none of it), for demos.

``reward_weights`` weighs them (default 1 each). Everything that can be wrong with them (a missing
file, an unknown function, one that is not callable, one whose return is not one number a
completion) is found before the model loads: each is loaded and called once on the data's first
prompt (:func:`check_rewards`), and a problem is one line naming the entry, the value and the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import UserError

#: A completion's length, in characters, where the built-in ``length`` reward is highest (without a ``target_length`` column).
DEFAULT_TARGET_CHARS = 32


class RewardError(UserError):
    """A reward function cannot be loaded, or returns what is not one reward a completion."""


def _text(completion: Any) -> str:
    """A completion's text (a conversational completion is a list of one assistant message)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def think_format(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 for a completion that opens with one ``<think>...</think>`` block, else 0.0 (TRL's ``think_format_reward``)."""
    pattern = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)
    return [1.0 if pattern.match(_text(c)) else 0.0 for c in completions]


def length(completions: Sequence[Any], target_length: Sequence[Any] | None = None, **kwargs: Any) -> list[float]:
    """1.0 for a completion of the target length in characters (the ``target_length`` column, else
    :data:`DEFAULT_TARGET_CHARS`), falling linearly to 0.0 at none or twice the target."""
    targets = list(target_length) if target_length is not None else [DEFAULT_TARGET_CHARS] * len(completions)
    return [max(0.0, 1.0 - abs(len(_text(c)) - float(t)) / float(t)) for c, t in zip(completions, targets)]


#: The built-in reward functions, by the name a config gives.
BUILTINS: dict[str, Callable[..., list[float]]] = {"think_format": think_format, "length": length}


@dataclass(frozen=True)
class Reward:
    """One reward function: its ``name`` (the function's, as TRL names ``rewards/<name>/mean``), the
    callable, its weight and the config entry that named it."""

    name: str
    function: Callable[..., Any]
    weight: float
    entry: str


def spec_problems(specs: Sequence[Any], weights: Sequence[Any] | None, base_dir: Path | None = None) -> list[str]:
    """What is wrong with ``reward_funcs`` and ``reward_weights`` without importing anything: the
    form of each entry, a file that is not there, weights of another count or not numbers."""
    problems = []
    for index, spec in enumerate(specs):
        name = f"reward_funcs[{index}]"
        if not isinstance(spec, str) or not spec.strip():
            problems.append(
                f"{name}: {spec!r} is not a reward function: write file.py:function, package.module:function, "
                f"or one of {', '.join(BUILTINS)}"
            )
            continue
        path, _, function = spec.rpartition(":")
        if not path:
            if spec not in BUILTINS:
                problems.append(
                    f"{name}: {spec!r} is not a built-in reward ({', '.join(BUILTINS)}); name a function as "
                    "file.py:function or package.module:function"
                )
            continue
        if not function.isidentifier():
            problems.append(f"{name}: {spec!r}: {function!r} is not a function name (file.py:function)")
        elif path.endswith(".py") and not _resolve(path, base_dir).is_file():
            problems.append(
                f"{name}: {spec!r}: {str(_resolve(path, base_dir))!r} is not a file (a path is relative to the "
                "config's folder)"
            )
    if weights is not None:
        if len(weights) != len(specs):
            problems.append(
                f"reward_weights: {len(weights)} weights for {len(specs)} reward_funcs: give one weight each"
            )
        for index, weight in enumerate(weights):
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                problems.append(f"reward_weights[{index}]: {weight!r} is not a number (e.g. 1.0)")
    return problems


def _resolve(path: str, base_dir: Path | None) -> Path:
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() or base_dir is None else base_dir / candidate


def load_rewards(
    specs: Sequence[str], weights: Sequence[float] | None = None, base_dir: Path | None = None
) -> list[Reward]:
    """The reward functions ``specs`` name, with their weights; raises :class:`RewardError`."""
    problems = spec_problems(specs, weights, base_dir)
    if problems:
        raise RewardError("\n".join(problems))
    weights = list(weights) if weights is not None else [1.0] * len(specs)
    rewards = []
    for index, (spec, weight) in enumerate(zip(specs, weights)):
        function = _load(f"reward_funcs[{index}]", spec, base_dir)
        rewards.append(
            Reward(
                name=getattr(function, "__name__", type(function).__name__),
                function=function,
                weight=float(weight),
                entry=spec,
            )
        )
    return rewards


def _load(name: str, spec: str, base_dir: Path | None) -> Callable[..., Any]:
    path, _, function = spec.rpartition(":")
    if not path:
        return BUILTINS[spec]
    try:
        if path.endswith(".py"):
            file = _resolve(path, base_dir)
            loader_spec = importlib.util.spec_from_file_location(f"memfit_rewards_{abs(hash(str(file)))}", file)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(path)
    except Exception as err:  # noqa: BLE001 - the user's module: any error it raises is theirs to see, in one line
        raise RewardError(f"{name}: {spec!r}: importing {path} failed: {type(err).__name__}: {err}") from None
    found = getattr(module, function, None)
    if found is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardError(
            f"{name}: {spec!r}: {path} defines no {function!r} (it defines {', '.join(defined) or 'no function'})"
        )
    if not callable(found):
        raise RewardError(f"{name}: {spec!r}: {function} is a {type(found).__name__}, not a function")
    return found


def score(
    rewards: Sequence[Reward],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
):
    """``[completions, functions]`` float32 rewards (NaN where a function returned None), each
    function called as TRL calls it; raises :class:`RewardError` for a return that is not one number
    (or None) a completion."""
    import torch

    out = torch.zeros(len(completions), len(rewards), dtype=torch.float32)
    for index, reward in enumerate(rewards):
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as err:  # noqa: BLE001 - the user's function: its error is shown as it raised it, in one line
            raise RewardError(
                f"reward_funcs[{index}]: {reward.entry!r} raised {type(err).__name__}: {err} (called as TRL calls "
                "it: prompts, completions, completion_ids and the dataset's other columns as keywords)"
            ) from None
        out[:, index] = torch.tensor(_checked(index, reward, values, len(completions)), dtype=torch.float32)
    return out


def _checked(index: int, reward: Reward, values: Any, count: int) -> list[float]:
    """``values`` as floats (None as NaN), or :class:`RewardError` naming what is wrong with them."""
    where = f"reward_funcs[{index}]: {reward.entry!r}"
    if not isinstance(values, (list, tuple)):
        raise RewardError(
            f"{where} returned a {type(values).__name__}: return a list of {count} numbers, one a completion"
        )
    if len(values) != count:
        raise RewardError(f"{where} returned {len(values)} rewards for {count} completions: return one a completion")
    out = []
    for value in values:
        if value is None:
            out.append(float("nan"))
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise RewardError(
                f"{where} returned {value!r} among its rewards: each must be a finite number (or None: not scored)"
            )
        else:
            out.append(float(value))
    return out


def check_rewards(rewards: Sequence[Reward], example: dict[str, Any]) -> None:
    """Call each reward function once, on ``example`` (the data's first prompt) and an empty
    completion, before the model loads: a function that raises or returns what is not one number a
    completion fails now, as a :class:`RewardError`."""
    prompt = example["prompt"]
    completion: Any = [{"role": "assistant", "content": ""}] if isinstance(prompt, list) else ""
    columns = {key: [value] for key, value in example.get("columns", {}).items()}
    score(rewards, [prompt], [completion], [[]], columns)

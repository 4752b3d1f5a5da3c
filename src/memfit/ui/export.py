"""What the page's settings are elsewhere: the ``memfit`` command line, and a ``memfit train`` YAML.

Both are made from the same query parameters the API reads (:mod:`memfit.ui.params`), so that
"copy as CLI" gives the command whose ``--json`` output is the page's answer.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from memfit.spec import TRAINED_KNOBS, flag


def check_values(options: Mapping[str, Any], knobs: Mapping[str, Any]) -> None:
    """Refuse settings that the command they are exported as would refuse, each value on its own:
    the knobs (:func:`memfit.spec.make_spec`), the GPU and budget, the CUDA context, and ``memfit
    fit``'s batch, length, GPUs and methods as the knobs they are; every problem at once, in the
    command line's words. (The model's name is checked as the page reads it; what depends on the
    model, a length past its positions, when it is planned.)"""
    from memfit.planner.errors import PlanError
    from memfit.planner.exact.runtime import context_bytes_problem
    from memfit.planner.target import resolve_target
    from memfit.spec import SpecError, make_spec

    values = dict(knobs, **{name: options[name] for name in ("batch_size", "seq_len", "gpus") if name in options})
    problems: list[str] = []
    for each in [values] + [{"method": method} for method in options.get("methods", ())]:
        try:
            make_spec(**each)
        except SpecError as err:
            problems.extend(p for p in err.problems if p not in problems)
    problems.extend(resolve_target(options.get("gpu"), options.get("budget"))[1])
    problems.extend(filter(None, [context_bytes_problem(options.get("context_bytes"))]))
    if problems:
        raise PlanError(problems, heading="cannot export these settings")


def command_line(command: str, params: Mapping[str, list[str]], model_file: str | None = None) -> str:
    """``memfit plan MODEL --opt value ...`` for ``params`` (names as the API takes them).

    ``model_file`` is the file name of a config.json dropped on the page, which the command line
    names by its path; switches given as true are written bare (``--exact``), false ones left out.
    """
    from memfit.ui.params import DEFAULT_MODEL, _flags

    parts = ["memfit", command]
    model = next((v for v in params.get("model", []) if v.strip()), DEFAULT_MODEL)
    parts.append(model_file or model)
    switches = _flags(command)
    for raw_name, values in params.items():
        name = raw_name.strip().lstrip("-").replace("-", "_")
        if name == "model":
            continue
        for value in values:
            if name in switches:
                if value.strip().lower() in ("", "true", "1", "yes", "on"):
                    parts.append(flag(name))
            elif value.strip():
                parts += [flag(name), value.strip()]
    return " ".join(shlex.quote(p) for p in parts)


def train_yaml(
    model: str,
    spec: Mapping[str, Any],
    *,
    gpu: str | None = None,
    budget: str | None = None,
    model_is_file: bool = False,
) -> str:
    """A ``memfit train`` YAML that trains ``spec`` (a plan's or a fit's ``spec``) on ``model``.

    As ``memfit fit --write`` writes it: the trained knobs, the GPU or budget, the demo dataset
    (to be replaced by your data), and ``init: random`` for a model without weights to load (a
    catalog name or a config.json; a Hub id's weights are downloaded by ``memfit train``).
    """
    import yaml

    from memfit.models.hub import looks_like_hub_id
    from memfit.train.config import demo_dataset_path

    values: dict[str, Any] = {"model": model}
    header = "# Written by memfit ui: the configuration on the page.\n"
    if model_is_file or not looks_like_hub_id(model):
        values["init"] = "random"
        header += (
            "# init: random trains random weights; point model: at your local Hugging Face folder and delete it.\n"
        )
    values["data"] = str(demo_dataset_path())
    header += "# data: the demo dataset; put your training data here.\n"
    multi_gpu = int(spec.get("gpus", 1) or 1) > 1
    for key in TRAINED_KNOBS:
        if key in spec and (multi_gpu or key not in ("gpus", "shard")):
            value = spec[key]
            values[key] = list(value) if isinstance(value, tuple) else value
    if gpu:
        values["gpu"] = gpu
    if budget:
        values["budget"] = budget
    return header + yaml.safe_dump(values, sort_keys=False, default_flow_style=False)

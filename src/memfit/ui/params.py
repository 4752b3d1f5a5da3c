"""Query parameters of the page's JSON API, read as ``memfit plan`` and ``memfit fit`` read their options.

``GET /api/plan?model=smollm2-135m&method=lora&seq_len=512`` means ``memfit plan smollm2-135m
--method lora --seq-len 512``: each parameter is a command-line option's name (``seq_len`` or
``seq-len``), its value the text the option would get. Knobs are converted and checked by
:func:`memfit.spec.make_spec`, as on the command line, so a bad value gets the CLI's message. An
empty value means the option is left off (a form's empty field). A name neither command knows is
one line with the closest option.

The model is only ever a name: a catalog name, a Hugging Face Hub id, or a config.json dropped on
the page (kept by the server, :mod:`memfit.ui.uploads`). Never a path on the server: the page must
not be able to make the server read a file it chooses.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import UserError
from memfit.options import FIT_KNOBS, whole_number
from memfit.spec import KNOBS, flag, value_kind

#: The model ``memfit plan`` plans when none is given (``memfit.cli.DEFAULT_MODEL``, tested equal).
DEFAULT_MODEL = "smollm2-135m"

#: ``memfit plan``'s options besides the model and the knobs (``as_json`` is the API itself).
PLAN_OPTIONS = ("revision", "gpu", "budget", "context_bytes", "exact", "no_cache")

#: ``--model`` (``model_override``: a config's model replaced) on the page: the model field is the model.
MODEL_OVERRIDE_REFUSED = (
    "the page's model field names the model: put it there, or edit the config's model before dropping it"
)
#: ``memfit plan`` options the page refuses, with why.
PLAN_REFUSED = {"model_override": MODEL_OVERRIDE_REFUSED}

#: ``memfit fit``'s options besides its knobs (:data:`memfit.options.FIT_KNOBS`, the command line's
#: own) that the page's search takes (``--write``, ``--data`` and ``--overwrite`` write files: the
#: page never names a server path; see :data:`FIT_REFUSED`).
FIT_OPTIONS = (
    "revision",
    "gpu",
    "budget",
    "batch_size",
    "seq_len",
    "method",
    "precision",
    "gpus",
    "shard",
    "max",
    "exact",
)
#: ``memfit fit`` options the page's search refuses, with why.
FIT_REFUSED = {
    "write": "the page writes no file on the server: use 'copy as YAML', or run the command it gives",
    "data": "the page writes no file on the server: use 'copy as YAML', or run the command it gives",
    "overwrite": "the page writes no file on the server: use 'copy as YAML', or run the command it gives",
    "no_cache": "the server's searches share its plan cache: start `memfit ui` with MEMFIT_PLAN_CACHE=0 to plan afresh",
    "model_override": MODEL_OVERRIDE_REFUSED,
}

_TRUE, _FALSE = ("true", "1", "yes", "on", ""), ("false", "0", "no", "off")


class QueryError(UserError, ValueError):
    """A query parameter the API cannot take: the message names it, the value and the fix."""


@dataclass
class Call:
    """What a query asks for: the model and the keyword arguments of the API function."""

    model: str
    options: dict[str, Any] = field(default_factory=dict)
    knobs: dict[str, str] = field(default_factory=dict)


def _key(name: str) -> str:
    return name.strip().lstrip("-").replace("-", "_")


def _single(
    params: Mapping[str, list[str]], known: tuple[str, ...], command: str, repeatable: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Parameter name -> value (a list for ``repeatable``), names normalised, unknown names refused."""
    values: dict[str, Any] = {}
    for raw_name, raw_values in params.items():
        name = _key(raw_name)
        if name == "model":
            continue
        if name not in known:
            refusal = (FIT_REFUSED if command == "fit" else PLAN_REFUSED).get(name)
            if refusal:
                raise QueryError(f"{flag(name)}: not taken here: {refusal}.")
            close = difflib.get_close_matches(name, known, n=1)
            hint = (
                f" Did you mean {flag(close[0])}?"
                if close
                else f" memfit {command} takes {', '.join(flag(k) for k in known)}."
            )
            raise QueryError(f"unknown option {flag(name)} for memfit {command}.{hint}")
        given = [v for v in raw_values if v.strip() != ""] if name not in _flags(command) else list(raw_values)
        if not given:
            continue  # an empty field: the option is left off
        if name in values or (len(given) > 1 and name not in repeatable):
            raise QueryError(f"{flag(name)} is given more than once; give it once.")
        values[name] = given if name in repeatable else given[0]
    return values


def _flags(command: str) -> tuple[str, ...]:
    """Options that are switches: ``?exact`` alone means on, as ``--exact`` does."""
    own = ("exact", "no_cache") if command == "plan" else ("exact",)
    return own + tuple(k for k in KNOBS if value_kind(k) == "bool")


def _switch(name: str, value: str) -> bool:
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise QueryError(f"{flag(name)}: {value!r} is not true or false (e.g. {name}=true).")


def page_model(params: Mapping[str, list[str]]) -> str:
    """The ``model`` parameter (default: :data:`DEFAULT_MODEL`), refused when it names a server path."""
    given = [v for v in params.get("model", []) if v.strip()]
    if len(given) > 1:
        raise QueryError("model is given more than once; give it once.")
    model = given[0].strip() if given else DEFAULT_MODEL
    check_page_model(model)
    return model


def check_page_model(model: str) -> None:
    """Refuse a model that is a path: the page names a catalog model, a Hub id or a dropped config.json."""
    from memfit.models.catalog import catalog_names, model_argument_problem
    from memfit.models.hub import looks_like_hub_id
    from memfit.ui.dropped_files import is_upload_name

    too_long = model_argument_problem(model)  # the command line's limit, before anything reads the name
    if too_long:
        raise QueryError(f"model: {too_long}")
    if model.lower() in catalog_names() or is_upload_name(model) or looks_like_hub_id(model):
        return
    if any(mark in model for mark in ("/", "\\", "~")) or model.startswith(".") or model.lower().endswith(".json"):
        raise QueryError(
            f"model: {model!r} is a path; the page never reads the server's files. Use a catalog name, a Hub id "
            "(org/name), or drop the config.json on the page."
        )
    # Anything else is a name: the planner says whether it knows it (with its closest names).


def plan_call(params: Mapping[str, list[str]]) -> Call:
    """The arguments of :func:`memfit.planner.api.plan` that ``memfit plan`` would pass for ``params``."""
    model = page_model(params)
    values = _single(params, PLAN_OPTIONS + KNOBS, "plan")
    options: dict[str, Any] = {}
    for name in ("revision", "gpu", "budget"):
        if name in values:
            options[name] = values.pop(name)
    if "context_bytes" in values:  # checked by the plan, as `memfit plan --context-bytes` is
        options["context_bytes"] = whole_number(values.pop("context_bytes"))
    options["exact"] = _switch("exact", values.pop("exact", "false"))
    options["cache"] = not _switch("no_cache", values.pop("no_cache", "false"))
    knobs = {name: ("true" if value == "" else value) for name, value in values.items()}
    return Call(model, options, knobs)


def fit_call(params: Mapping[str, list[str]]) -> Call:
    """The :class:`~memfit.planner.search.request.FitRequest` ``memfit fit`` would make for ``params``:
    its fields (``options``) and the knobs every plan holds (``knobs``)."""
    model = page_model(params)
    values = _single(params, FIT_OPTIONS + FIT_KNOBS, "fit", repeatable=("method",))
    options: dict[str, Any] = {}
    for name in ("revision", "gpu", "budget"):
        if name in values:
            options[name] = values.pop(name)
    # Whole numbers as `memfit fit` reads them: text that is not one goes on to the search's checks,
    # which name it with every other problem (the command line's message).
    if "batch_size" in values:  # left off: 8, or a dropped tool config's own effective batch
        options["batch_size"] = whole_number(values.pop("batch_size"))
    if "seq_len" in values:
        options["seq_len"] = whole_number(values.pop("seq_len"))
    if "method" in values:
        options["methods"] = tuple(values.pop("method"))
    gpus = whole_number(values.pop("gpus", "1"))
    if gpus != 1:
        options["gpus"] = gpus
    max_target = values.pop("max", None)
    if max_target is not None and max_target != "seq-len":
        raise QueryError(f"--max: {max_target!r} is not one of seq-len.")
    if "exact" in values:
        options["exact"] = _switch("exact", values.pop("exact"))
    return Call(model, options, dict(values))


def plan_spec(text: str) -> dict[str, Any]:
    """``/api/export``'s ``spec``: a plan's spec as JSON, its knobs checked as ``memfit train`` checks
    a config's (:func:`memfit.spec.make_spec`), so that the YAML made of it is one memfit trains."""
    import json

    from memfit.spec import SpecError, make_spec

    try:
        spec = json.loads(text)
    except (ValueError, RecursionError) as err:
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deep"
        raise QueryError(
            f'spec: {text!r} is not valid JSON ({reason}); send a plan\'s spec (its "spec" object).'
        ) from None
    if not isinstance(spec, dict):
        raise QueryError(f'spec: {text!r} is not a JSON object; send a plan\'s spec (its "spec" object).')
    try:
        make_spec(spelling="field", **{k: v for k, v in spec.items() if k in KNOBS})
    except SpecError as err:
        raise QueryError(f"spec: not a spec memfit trains: {'; '.join(err.problems)}") from None
    return spec

"""Command-line options made from declared fields, so that each knob is declared once.

:func:`knob_options` turns :class:`~memfit.spec.RunSpec` knobs, and :func:`field_options` the
fields of any pydantic model (the training config's), into Typer options; :func:`with_options`
adds them to a command function, which receives them as keyword arguments. Knob options are read
as text and validated by :func:`memfit.spec.make_spec`, so that every bad value on a command line
is reported at once, with its fix, rather than the first one alone. An option left off is ``None``:
the declared default applies.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable, Iterable, Optional

import typer

from memfit import spec as specs

#: The RunSpec knobs ``memfit fit`` takes as given, the same in every plan of its search (the search
#: chooses method, checkpointing, optimizer and the batch split; batch size, sequence length,
#: precision, GPUs and sharding are fit options of their own). memfit ui's search takes these too.
FIT_KNOBS = ("rank", "alpha", "dropout", "targets", "dora", "rslora", "modules_to_save", "objective", "precompute_reference",
             "recipe", "hf_loss")


def knob_options(names: Iterable[str] | None = None, *, help: dict[str, str] | None = None) -> list[inspect.Parameter]:
    """Options for the RunSpec knobs ``names`` (default: all), with the declared help and default.

    ``help`` replaces a knob's help where a command gives the knob another meaning.
    """
    params = []
    for name in names if names is not None else specs.KNOBS:
        text = (help or {}).get(name) or specs.help_text(name)
        allowed = specs.choices(name)
        is_bool = specs.default(name) is False or specs.default(name) is True
        declared = specs.default(name)
        if is_bool:
            option = typer.Option(None, specs.flag(name), help=text, show_default=False)
            annotation: Any = Optional[bool]
        else:
            shown = (",".join(declared) or "none") if isinstance(declared, tuple) else declared
            if shown is not None:
                text = f"{text} \\[default: {shown}]"  # escaped: Typer's help is Rich markup
            decls = [specs.flag(name)] + ([specs.short_flag(name)] if specs.short_flag(name) else [])
            metavar = "|".join(allowed) if allowed else _metavar(name)
            option = typer.Option(None, *decls, help=text, metavar=metavar, show_default=False)
            annotation = Optional[str]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


def field_options(model: type, names: Iterable[str]) -> list[inspect.Parameter]:
    """Options for fields ``names`` of pydantic ``model``: its type, its description as help,
    ``json_schema_extra={"short": "-o"}`` as an alias. Each defaults to None (the field's default)."""
    params = []
    for name in names:
        info = model.model_fields[name]
        annotation = _optional(info.annotation)
        decls = [specs.flag(name)]
        short = (info.json_schema_extra or {}).get("short") if isinstance(info.json_schema_extra, dict) else None
        if short:
            decls.append(short)
        text = info.description or ""
        if annotation is Optional[bool]:
            option = typer.Option(None, decls[0], help=text, show_default=False)
        else:
            option = typer.Option(None, *decls, help=text, show_default=False)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


def with_options(*groups: list[inspect.Parameter]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the option ``groups`` to a command function that takes ``**options``."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(func, eval_str=True)
        params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in params}
        for group in groups:
            for p in group:
                if p.name in taken:
                    raise ValueError(f"option {p.name!r} is declared twice on {func.__name__}")
                taken.add(p.name)
                params.append(p)

        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not inspect.Parameter.empty}
        return command

    return decorate


def _optional(annotation: Any) -> Any:
    """``X | None`` as Typer reads it; Literal and list types are kept, unions reduced to their type."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", ())) and len(args) == 1:
        annotation = args[0]
    return Optional[annotation]


def _metavar(name: str) -> str:
    kind = specs.value_kind(name)
    return {"int": "INT", "float": "NUMBER"}.get(kind, "TEXT")

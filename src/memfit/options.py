"""Command-line options made from declared fields, so that each option is declared once.

:func:`knob_options` turns :class:`~memfit.spec.RunSpec` knobs, and :func:`field_options` the
fields of any pydantic model (the training config's), into Typer options; :class:`CommandOption`
declares an option several commands share that is not a knob (``--gpu``, ``--budget``,
``--revision``), and :func:`command_options` makes it for one command; :func:`with_options` adds
them to a command function, which receives them as keyword arguments. Knob options are read
as text and validated by :func:`memfit.spec.make_spec`, so that every bad value on a command line
is reported at once, with its fix, rather than the first one alone. An option left off is ``None``:
the declared default applies. :func:`hidden_options` are options a command takes only to refuse
them with a message of its own (memfit train's settings given to memfit plan), and a
:class:`RefusingCommand` never suggests one of them for a mistyped option.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import typer

from memfit import spec as specs

#: The RunSpec knobs ``memfit fit`` takes as given, the same in every plan of its search (the search
#: chooses method, checkpointing, optimizer and the batch split; batch size, sequence length,
#: precision, GPUs and sharding are fit options of their own). memfit ui's search takes these too.
FIT_KNOBS = (
    "rank",
    "alpha",
    "dropout",
    "targets",
    "dora",
    "rslora",
    "modules_to_save",
    "objective",
    "precompute_reference",
    "recipe",
    "hf_loss",
    "beta",
    "num_generations",
    "max_completion_length",
    "num_iterations",
    "temperature",
    "top_p",
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    "adamw_impl",
    "sequence_parallel",
)


def knob_options(
    names: Iterable[str] | None = None, *, help: Mapping[str, str] | None = None, repeatable: Iterable[str] = ()
) -> list[inspect.Parameter]:
    """Options for the RunSpec knobs ``names`` (default: all), with the declared help and default.

    ``help`` replaces a knob's help where a command gives the knob another meaning; that help says
    the command's own default, so the declared one is not added to it. A ``repeatable`` knob's
    option may be given several times (``--method lora --method qlora``): a list of texts.
    """
    params = []
    repeated = set(repeatable)
    for name in names if names is not None else specs.KNOBS:
        own = (help or {}).get(name)
        text = own or specs.help_text(name)
        allowed = specs.choices(name)
        is_bool = specs.default(name) is False or specs.default(name) is True
        declared = specs.default(name)
        if is_bool:
            # A knob on by default is turned off by its --no- spelling (--no-freeze-vision); one off by
            # default by its flag alone (a --no- spelling beside it would only crowd the help).
            decl = f"{specs.flag(name)}/--no-{specs.flag(name)[2:]}" if declared is True else specs.flag(name)
            option = typer.Option(None, decl, help=text, show_default=False)
            annotation: Any = bool | None
        else:
            shown = (",".join(declared) or "none") if isinstance(declared, tuple) else declared
            if shown is not None and own is None:
                text = f"{text} \\[default: {shown}]"  # escaped: Typer's help is Rich markup
            decls = [specs.flag(name)] + ([specs.short_flag(name)] if specs.short_flag(name) else [])
            metavar = "|".join(allowed) if allowed else _metavar(name)
            option = typer.Option(None, *decls, help=text, metavar=metavar, show_default=False)
            annotation = list[str] | None if name in repeated else str | None
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


def whole_number(text: str | None) -> int | str | None:
    """A whole-number option's text as an int; other text unchanged, for the validation that names
    it with every other bad value (:func:`memfit.spec.make_spec` and the searches' checks)."""
    if text is None:
        return None
    number = specs.whole_number_value(text)
    return number if isinstance(number, int) else text


@dataclass(frozen=True)
class CommandOption:
    """An option several commands take that is not a RunSpec knob, declared once.

    ``name`` is its Python name (``--gpu`` is ``gpu``, as the training YAML's field); ``help`` its
    help on every command but those in ``per_command``, where the option means more (a default of
    its own), each with the reason beside it. The training config's field takes the ``train`` help
    as its description, so that the YAML reference and ``memfit train --help`` say the same.
    """

    name: str
    help: str
    metavar: str = "TEXT"
    per_command: Mapping[str, str] = field(default_factory=dict)
    #: The flag's word where it is not the Python name's (``--model`` beside a ``model`` argument).
    word: str | None = None

    @property
    def flag(self) -> str:
        return specs.flag(self.word or self.name)

    def help_for(self, command: str) -> str:
        """The help this option has on ``memfit command``."""
        return self.per_command.get(command, self.help)

    def parameter(self, command: str) -> inspect.Parameter:
        """This option as a keyword parameter of ``memfit command`` (None when left off)."""
        option = typer.Option(None, self.flag, help=self.help_for(command), metavar=self.metavar, show_default=False)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=str | None)

    def annotated(self, command: str) -> Any:
        """This option as the ``Annotated`` type of a parameter of ``memfit command`` (give it the default None)."""
        option = typer.Option(self.flag, help=self.help_for(command), metavar=self.metavar, show_default=False)
        return typing.Annotated[str | None, option]


REVISION = CommandOption(
    "revision",
    "Branch, tag or commit of a Hugging Face Hub model (default: main).",
    metavar="REV",
    # merge reads two models, each of which may be on the Hub: this is the base's (--adapter-revision the adapter's).
    per_command={"merge": "Branch, tag or commit of a Hub --base (default: main)."},
)
GPU = CommandOption(
    "gpu",
    "GPU to plan against (see `memfit models`).",
    metavar="NAME",
    # train plans before it loads, and without a GPU or budget it plans against the device it runs on.
    per_command={
        "train": "GPU to plan against before loading (see `memfit models`; default: the CUDA device's free memory).",
        "calibrate": "The card the run ran on (see `memfit models`), when its plan names none.",
    },
)
BUDGET = CommandOption(
    "budget",
    "Memory budget to plan against, e.g. 24GiB (with --gpu: at most the card's memory).",
    metavar="SIZE",
    # train: a budget is also how a CPU run checks that it would fit a GPU.
    per_command={
        "train": "Memory budget to plan against before loading, e.g. 24GiB, also on CPU runs (with a GPU named: "
        "at most the card's memory)."
    },
)
#: What a plan is compared against (``memfit plan``, ``fit`` and ``train``), and which model revision
#: (chat, generate and merge take ``--revision`` too).
TARGET_OPTIONS = (REVISION, GPU, BUDGET)
#: ``memfit plan CONFIG --model`` and ``fit``: another model for a training config (its ``model`` is the command's argument).
CONFIG_MODEL = CommandOption(
    "model_override",
    "With a training config as MODEL (Axolotl, LLaMA-Factory, TRL, or memfit's own YAML): plan this model "
    "in place of the config's: a folder, a config.json, a catalog name or a Hub id.",
    metavar="MODEL",
    word="model",
)


def command_options(command: str, declared: Iterable[CommandOption] = TARGET_OPTIONS) -> list[inspect.Parameter]:
    """The ``declared`` options (default: :data:`TARGET_OPTIONS`) as ``memfit command`` takes them."""
    return [option.parameter(command) for option in declared]


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
        if annotation == bool | None:
            option = typer.Option(None, decls[0], help=text, show_default=False)
        else:
            option = typer.Option(None, *decls, help=text, show_default=False)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


def hidden_options(flags: Mapping[str, tuple[str, bool]]) -> list[inspect.Parameter]:
    """Options left out of ``--help``, ``flags`` mapping each name to its flag and whether it is a
    flag (takes no value): a command takes them only to answer them with a message of its own (the
    options of another command given to this one), rather than with the parser's "no such option".
    A value is taken as text, whatever it is."""
    params = []
    for name, (flag, is_flag) in flags.items():
        option = typer.Option(None, flag, hidden=True, show_default=False)
        annotation: Any = bool | None if is_flag else str | None
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


class RefusingCommand(typer.core.TyperCommand):
    """A command with :func:`hidden_options`: a mistyped option is never answered with one of them
    ("did you mean --lr?" on a command that refuses --lr), only with the options it does take."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        import difflib

        try:
            return super().parse_args(ctx, args)
        except Exception as err:
            if type(err).__name__ != "NoSuchOption":  # click's, which Typer vendors (typer._click), not exported
                raise
            shown = [
                opt
                for param in self.params
                if not getattr(param, "hidden", False)
                for opt in param.opts
                if opt.startswith("--")
            ]
            err.possibilities = difflib.get_close_matches(err.option_name, shown) or None  # type: ignore[attr-defined]
            raise


def with_options(
    *groups: list[inspect.Parameter],
    first: Sequence[list[inspect.Parameter]] = (),
    refused: Callable[[set[str]], list[inspect.Parameter]] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the option ``groups`` to a command function that takes ``**options``: after its own
    options, or, the ``first`` groups, right after its arguments (the order of ``--help``).
    ``refused`` makes, from the names the command takes, the hidden options it takes only to refuse
    (:func:`hidden_options`), added last."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(func, eval_str=True)
        params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        leading = 0
        while leading < len(params) and _is_argument(params[leading]):
            leading += 1
        taken = {p.name for p in params}
        added: list[inspect.Parameter] = []
        for group in (*first, *groups):
            for p in group:
                if p.name in taken:
                    raise ValueError(f"option {p.name!r} is declared twice on {func.__name__}")
                taken.add(p.name)
                added.append(p)
        if refused is not None:
            for p in refused(set(taken)):
                taken.add(p.name)
                added.append(p)
        ahead = sum(len(group) for group in first)
        params = params[:leading] + added[:ahead] + params[leading:] + added[ahead:]
        # A signature lists keyword-only parameters last, so the command's own options after the first
        # groups become keyword-only too (Typer passes every option by name).
        params = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            if i >= leading and p.kind is not inspect.Parameter.KEYWORD_ONLY
            else p
            for i, p in enumerate(params)
        ]

        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not inspect.Parameter.empty}
        return command

    return decorate


def _is_argument(param: inspect.Parameter) -> bool:
    """A command's argument (or its Typer context), which its options follow."""
    marks = [param.default, *getattr(param.annotation, "__metadata__", ())]
    return param.annotation is typer.Context or any(isinstance(mark, typer.models.ArgumentInfo) for mark in marks)


def _optional(annotation: Any) -> Any:
    """``X | None`` as Typer reads it; Literal and list types are kept, unions reduced to their type."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if (
        typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", ()))
        and len(args) == 1
    ):
        annotation = args[0]
    return annotation | None


def _metavar(name: str) -> str:
    kind = specs.value_kind(name)
    return {"int": "INT", "float": "NUMBER"}.get(kind, "TEXT")

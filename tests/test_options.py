"""Each command-line option is declared once: the knobs in memfit.spec, the options several commands
share (--gpu, --budget, --revision) in memfit.options, and every command builds its options from them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import typer.main

from memfit import options, spec
from memfit.cli import FIT_OWN_KNOBS, app
from memfit.options import (
    BUDGET,
    GPU,
    REVISION,
    TARGET_OPTIONS,
    command_options,
    knob_options,
    whole_number,
    with_options,
)

SRC = Path(options.__file__).resolve().parent
#: Options that plan, fit and train (and chat, generate, merge for --revision) share, and the knobs fit gives its own help.
SHARED_FLAGS = {o.flag for o in TARGET_OPTIONS} | {spec.flag(name) for name in FIT_OWN_KNOBS}


def _option_flags_written_out() -> list[tuple[str, int, str]]:
    """(file, line, flag) of every shared flag written as text in a typer.Option(...) call."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "Option":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and arg.value in SHARED_FLAGS:
                        found.append((str(path.relative_to(SRC)), node.lineno, arg.value))
    return found


def test_no_command_writes_out_a_shared_option_of_its_own():
    # A second `typer.Option("--gpu", ...)` would be a second declaration, free to drift from the first.
    assert _option_flags_written_out() == []


def _click_options(command: str) -> dict[str, object]:
    click_command = typer.main.get_command(app).commands[command]
    return {opt: param for param in click_command.params for opt in getattr(param, "opts", ())}


@pytest.mark.parametrize("command", ["plan", "fit", "train"])
def test_plan_fit_and_train_take_the_one_declaration(command):
    taken = _click_options(command)
    for declared in TARGET_OPTIONS:
        assert taken[declared.flag].help == declared.help_for(command)


def test_chat_generate_and_merge_take_the_one_revision():
    for command in ("chat", "generate", "merge"):
        assert _click_options(command)["--revision"].help == REVISION.help_for(command)
    assert REVISION.help_for("merge") != REVISION.help


def test_the_training_config_describes_its_fields_as_train_helps_its_options():
    from memfit.train.config import TrainConfig

    for declared in (REVISION, GPU, BUDGET):
        assert TrainConfig.model_fields[declared.name].description == declared.help_for("train")


def test_fit_knobs_are_the_run_spec_knobs_with_fits_help():
    taken = _click_options("fit")
    for name, text in FIT_OWN_KNOBS.items():
        param = taken[spec.flag(name)]
        assert set(param.opts) == {spec.flag(name)} | ({spec.short_flag(name)} if spec.short_flag(name) else set())
        assert param.help == text  # the command's own default, not the knob's
    assert taken["--method"].multiple and taken["--method"].metavar == "|".join(spec.choices("method"))


def test_knob_options_repeatable_and_own_help():
    (method,) = knob_options(["method"], help={"method": "Only these."}, repeatable=["method"])
    assert method.annotation == list[str] | None
    assert method.default.help == "Only these."
    (rank,) = knob_options(["rank"])
    assert rank.default.help.endswith("\\[default: 16]")


def test_an_option_declared_twice_on_one_command_is_refused():
    def command(**opts):
        return opts

    with pytest.raises(ValueError, match="option 'revision' is declared twice on command"):
        with_options(command_options("plan"), first=[command_options("fit")])(command)


def test_first_options_follow_the_arguments():
    def command(model: str = typer.Argument("m"), as_json: bool = typer.Option(False, "--json"), **opts):
        return model, as_json, opts

    wrapped = with_options(knob_options(["rank"]), first=[command_options("plan")])(command)
    assert list(inspect.signature(wrapped).parameters) == ["model", "revision", "gpu", "budget", "as_json", "rank"]


@pytest.mark.parametrize(
    ("text", "value"),
    [(None, None), ("8", 8), (" 8 ", 8), ("-3", -3), ("x", "x"), ("1.5", "1.5"), ("--3", "--3"), ("²", "²")],
)
def test_whole_number_converts_only_whole_numbers(text, value):
    assert whole_number(text) == value


@pytest.mark.parametrize("command", ["plan", "fit", "train"])
def test_a_knob_on_by_default_is_turned_off_on_the_command_line(command):
    # --no-freeze-vision, --no-kbit-upcast: the only way to say false for a knob that is true by default.
    click_command = typer.main.get_command(app).commands[command]
    for name in (n for n in spec.KNOBS if spec.default(n) is True):
        option = next((p for p in click_command.params if p.name == name), None)
        if option is None:
            continue  # a knob this command does not take
        assert spec.flag(name) in option.opts and "--no-" + spec.flag(name)[2:] in option.secondary_opts, name

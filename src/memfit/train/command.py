"""`memfit train`: the command-line face of :func:`memfit.train.recipe.train`.

Importing this module imports neither torch nor transformers, so the CLI starts fast. Exit codes:
0 finished (or, with --resume, already finished), 2 bad configuration or input, 3 the run does not
fit (preflight refusal or out of memory, with a checkpoint to resume from), 128 + signal number
after SIGINT (130) / SIGTERM (143) once the checkpoint is saved (a signal during the last step lets
the run complete and write its output: 0). Errors are printed by
:func:`memfit.errors.cli_errors`, which wraps the command.

``--nproc N`` starts the same command on N processes through ``torchrun`` (one per GPU, on this
machine) and exits with its exit code.
"""

from __future__ import annotations

import functools
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from memfit.errors import UserError, cli_errors, listed
from memfit.options import TARGET_OPTIONS, command_options, field_options, hidden_options, knob_options, with_options
from memfit.spec import KNOBS, TRAINED_KNOBS, flag
from memfit.train.config import ConfigError, TrainConfig


def parse_set_options(items: list[str]) -> dict[str, Any]:
    """``["lr=1e-4", "targets=[q_proj, v_proj]"]`` -> ``{"lr": 1e-4, "targets": ["q_proj", "v_proj"]}``
    (values are read as YAML). Raises :class:`ConfigError` listing every malformed item."""
    import yaml

    from memfit.train.config import yaml_problem

    out: dict[str, Any] = {}
    problems = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: write KEY=VALUE, e.g. --set warmup_steps=20")
            continue
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError as err:
            problems.append(
                f"--set {item!r}: the value is {yaml_problem(err)} "
                "(values are read as YAML: quote text, e.g. --set 'key=\"a: b\"')"
            )
            continue
        if isinstance(parsed, str):
            try:  # YAML 1.1 reads 1e-4 (no dot) as a string
                parsed = float(parsed)
            except ValueError:
                pass
        out[key.strip().replace("-", "_")] = parsed
    if problems:
        raise ConfigError(problems)
    return out


def relaunch_args(params: list[tuple[Any, Any]], skip: tuple[str, ...] = ("nproc",)) -> list[str]:
    """Command-line arguments that repeat a parsed invocation: ``params`` is (click parameter, value)
    pairs; unset options (None, or a flag left off) and the ``skip`` parameters are left out."""
    args: list[str] = []
    for param, value in params:
        if param.name in skip or value is None:
            continue
        if getattr(param, "param_type_name", "") == "argument":
            args.append(str(value))
            continue
        flag = param.opts[0]
        if getattr(param, "is_flag", False):
            if value and value != param.default:
                args.append(flag)
            elif value is False and param.default is None and param.secondary_opts:
                args.append(param.secondary_opts[0])  # --no-X: a YAML setting turned off
        elif getattr(param, "multiple", False):
            for item in value:
                args += [flag, str(item)]
        else:
            args += [flag, str(value)]
    return args


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """``python -m torch.distributed.run`` starting ``memfit train args`` on ``nproc`` local processes
    (``--standalone``: one machine, a free port picked by torchrun)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "memfit",
        "train",
        *args,
    ]


def run_forwarding_signals(command: list[str]) -> int:
    """Run ``command`` and return its exit code (128 + N when signal N ended it).

    Ctrl-C reaches torchrun from the terminal directly, and a SIGTERM sent to this process is passed
    on: either way the ranks save a checkpoint and stop together, so this process only waits.
    """
    proc = subprocess.Popen(command)
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum)),
    }
    try:
        code = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code


def nproc_problem(nproc: int, gpus: int, env: dict[str, str] | None = None) -> str | None:
    """Why ``--nproc`` cannot start this config (None when it can)."""
    env = os.environ if env is None else env
    if nproc < 1:
        return f"--nproc: {nproc} must be 1 or more (one process per GPU)"
    if env.get("WORLD_SIZE"):
        return "--nproc: this command already runs under torchrun (WORLD_SIZE is set); drop --nproc"
    if nproc != gpus:
        return (
            f"--nproc {nproc}, but the config says gpus: {gpus}. Set gpus: {nproc} in the config "
            f"(or --set gpus={nproc}, with a shard such as --set shard=fsdp), or use --nproc {gpus}."
        )
    return None


@cli_errors
@with_options(
    knob_options(TRAINED_KNOBS),
    field_options(
        TrainConfig,
        (
            "lr",
            "epochs",
            "max_steps",
            "seed",
            "device",
            "output_dir",
            "force",
            "report_to",
            "loss_type",
            "simpo_gamma",
            "cpo_alpha",
        ),
    ),
    command_options("train"),
)
def train_command(
    ctx: typer.Context,
    config: Annotated[
        Path,
        typer.Argument(
            help="YAML training config (see docs/train.md; examples/tiny.yaml is a demo).", show_default=False
        ),
    ],
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in output_dir from its latest checkpoint.")
    ] = False,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Any other config field: --set KEY=VALUE (repeatable).")
    ] = None,
    no_progress: Annotated[
        bool, typer.Option("--no-progress", help="No live progress bar (metrics still go to metrics.jsonl).")
    ] = False,
    nproc: Annotated[
        int | None,
        typer.Option("--nproc", help="Start N processes (one per GPU) with torchrun; must equal gpus in the config."),
    ] = None,
    fit: Annotated[
        bool,
        typer.Option(
            "--fit",
            help="Before loading, choose the micro-batch split, checkpointing and tiling that fit the device (fit: auto).",
        ),
    ] = False,
    **options: Any,
) -> None:
    """Fine-tune a model as a YAML config says: plan first, then train, checkpoint and save the adapter.

    Every option overrides the YAML field of the same name. Exit code 0: trained (or, with --resume,
    already finished); 2: bad config or input; 3: does not fit (preflight) or ran out of memory;
    130 / 143: stopped by SIGINT / SIGTERM after saving a checkpoint."""
    from memfit.console import make_console

    console = make_console(stderr=True)
    cfg = _train_config(config, set_ or [], options, fit=fit)
    if nproc is not None:
        _start_on_processes(ctx, nproc, cfg.gpus, console)

    _quiet_library_notices()
    from memfit.train.recipe import train

    result = train(cfg, resume=resume, console=console, progress=not no_progress)
    _report_result(result, cfg, ctx, _rank_zero_print(console))


def _train_config(config: Path, set_: list[str], options: dict[str, Any], fit: bool) -> TrainConfig:
    """The YAML config at ``config`` with the command line's settings over it: ``--set`` items, then
    the options given, then ``--fit``."""
    from memfit.train.config import load_config

    overrides = parse_set_options(set_)
    # A flag left off is None: it must not undo a --set of the same field (--set gpus=2).
    overrides.update({name: value for name, value in options.items() if value is not None})
    if fit:
        overrides["fit"] = "auto"
    return load_config(config, overrides)


def _start_on_processes(ctx: typer.Context, nproc: int, gpus: int, console: Any) -> None:
    """Refuse an ``--nproc`` the config cannot run; for more than one process, run this same command
    under torchrun and exit with its exit code (one process goes on in this one)."""
    problem = nproc_problem(nproc, gpus)
    if problem:
        raise ConfigError([problem])
    if nproc > 1:
        command = torchrun_command(nproc, _given_args(ctx))
        console.print(f"starting {nproc} processes: {' '.join(command[1:])}", highlight=False)
        raise typer.Exit(code=run_forwarding_signals(command))


def _given_args(ctx: typer.Context, skip: tuple[str, ...] = ("nproc",)) -> list[str]:
    """The arguments of this invocation, every option given (-o, --set...), less the ``skip`` ones."""
    return relaunch_args([(p, ctx.params.get(p.name)) for p in ctx.command.params], skip=skip)


def _rank_zero_print(console: Any) -> Callable[..., None]:
    """``console.print`` on rank 0 and a no-op on the others: under torchrun every rank runs this
    command, and one of them reports how the run ended (errors come from every rank)."""
    if os.environ.get("RANK", "0") in ("", "0"):
        return console.print
    return lambda *args, **kwargs: None


def _report_result(result: Any, cfg: TrainConfig, ctx: typer.Context, say: Callable[..., None]) -> None:
    """Say how the run ended; a run stopped by a signal exits with 128 + the signal's number."""
    if result.status == "finished":
        _say_already_finished(result, say)
    elif result.status == "interrupted":
        _say_stopped(result, cfg, ctx, say)
        raise typer.Exit(code=128 + int(getattr(signal, result.signal_name or "SIGINT")))
    else:
        _say_done(result, say)


def _say_already_finished(result: Any, say: Callable[..., None]) -> None:
    """A --resume of a run that had completed: nothing changed, and how to train longer instead."""
    from rich.markup import escape

    say(
        f"[green]already finished[/]: {escape(str(result.run_dir))} completed its {result.step} steps; nothing was "
        f"changed. Its output is {escape(str(result.output_dir))}. To train longer, raise max_steps or epochs "
        "and resume; to start over, choose another output_dir.",
        highlight=False,
    )


def _say_stopped(result: Any, cfg: TrainConfig, ctx: typer.Context, say: Callable[..., None]) -> None:
    """Where a run stopped by a signal saved its checkpoint, and the command that finishes it."""
    from rich.markup import escape

    # The exact command, with every option given (-o, --set...), so that the resume continues this run.
    again = ["memfit", "train", *_given_args(ctx, skip=("nproc", "resume")), "--resume"]
    output = "adapter" if cfg.spec.uses_adapters else "model"
    say(
        f"[yellow]stopped[/] by {result.signal_name} at step {result.step} of {result.total_steps}; checkpoint at "
        f"{escape(str(result.checkpoint))}; run `{escape(shlex.join(again))}` to finish and write the {output}",
        highlight=False,
        soft_wrap=True,
    )


def _say_done(result: Any, say: Callable[..., None]) -> None:
    """A finished run's summary: steps, loss from where it began to its end, eval loss, throughput, and
    where its output, metrics and run record are."""
    if result.signal_name:
        say(
            f"{result.signal_name} arrived during the last step: the run finished it and wrote its output",
            highlight=False,
        )
    evals = f", eval loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
    rate = f", {result.tokens_per_second:.0f} tokens/s" if result.tokens_per_second else ""
    # From where the run began (a resumed run's first step is not it) to its last step. A resume whose
    # checkpoint was the last step (its output had not been written) trains nothing.
    first = result.first_loss or (result.losses[0] if result.losses else None)
    losses = (
        f"loss {first[1]:.4f} -> {result.losses[-1][1]:.4f}"
        if result.losses and first is not None
        else "none left to train, the output written from the last checkpoint"
    )
    say(
        f"[green]done[/]: {result.step} steps, {losses}{evals}{rate}\n"
        f"  output  {result.output_dir}\n  metrics {result.run_dir / 'metrics.jsonl'}\n  run     {result.run_dir / 'run.json'}",
        highlight=False,
    )


# ------------------------------------------------------------------------------------------------
# Training settings given to memfit plan or fit


#: The training settings that do change what a plan is of, and what memfit plan and fit take instead.
PLANNED_INSTEAD = {
    "data": "the sequence length planned is --seq-len (memfit train plans at its data's longest example)",
    "model_overrides": "plan a config.json with the overrides written into it",
    "fit": "memfit fit is that search",
    "fit_optimizer": "memfit fit searches the optimizers of a full fine-tune itself",
    "nproc": "the processes of a run are its GPUs, --gpus",
    "set_": "each knob is an option of its own (see --help); training-config fields do not change memory",
}


@functools.lru_cache(maxsize=1)
def training_settings() -> dict[str, tuple[str, bool]]:
    """memfit train's options and its config's fields that are not a plan's (the knobs, --gpu,
    --budget, --revision, the model): name -> (flag, whether it takes no value). Made from
    ``memfit train``'s own options and :class:`~memfit.train.config.TrainConfig`'s fields, so that
    a setting added to either is here too."""
    app = typer.Typer()
    app.command()(train_command)
    planned = {*KNOBS, *(option.name for option in TARGET_OPTIONS), "model"}
    settings = {
        param.name: (param.opts[0], bool(getattr(param, "is_flag", False)))
        for param in typer.main.get_command(app).params
        if param.param_type_name == "option" and param.name not in planned
    }
    for name, info in TrainConfig.model_fields.items():
        if name not in planned and name not in settings:
            settings[name] = (flag(name), info.annotation is bool)
    return settings


def training_options(taken: set[str]) -> list:
    """The training settings a command (memfit plan, fit) does not take itself (``taken``: the
    names it has), as hidden options that :func:`refuse_training_settings` answers."""
    return hidden_options({name: flag for name, flag in training_settings().items() if name not in taken})


def refuse_training_settings(options: dict[str, Any], command: str) -> None:
    """Take the training settings out of a command's ``options`` and refuse those given: one line
    each, saying what the setting is (a training-config field, an option of memfit train), that it
    does not change memory, or what ``memfit command`` takes instead."""
    given = {name: options.pop(name) for name in list(options) if name in training_settings()}
    problems = [_refusal(name, value, command) for name, value in given.items() if value not in (None, False)]
    if problems:
        raise UserError(
            problems[0] if len(problems) == 1 else listed(f"memfit {command} does not take these", problems)
        )


def _refusal(name: str, value: Any, command: str) -> str:
    flag = training_settings()[name][0]
    shown = flag if value is True else f"{flag} {value}"
    what = (
        f"{name} is a training-config field ({name}: in memfit train's YAML)"
        if name in TrainConfig.model_fields
        else "an option of memfit train"
    )
    instead = PLANNED_INSTEAD.get(name)
    if instead:
        return f"{shown}: {what}, not an option of memfit {command}: {instead}."
    return f"{shown}: {what} that does not change memory, so memfit {command} does not take it. Drop {flag}."


def _quiet_library_notices() -> None:
    """Hide transformers' deprecation notices about method names: they are for library authors."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.* is deprecated", category=FutureWarning)

"""The ``memfit`` command line: parse, call the Python API, render. No logic lives here.

Every command is wrapped in :func:`memfit.errors.cli_errors`: a mistake in the input ends it with
one ``error:`` line (or a short list) and exit code 2, a run or search that does not fit with 3,
and never with a traceback (see :mod:`memfit.errors` for the codes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, NoReturn

import typer

from memfit.collector import collect_less
from memfit.console import StatusLine, make_console
from memfit.errors import EXIT_DOES_NOT_FIT, PathError, cli_errors
from memfit.exits import end_process
from memfit.options import (
    CONFIG_MODEL,
    FIT_KNOBS,
    TARGET_OPTIONS,
    RefusingCommand,
    command_options,
    knob_options,
    whole_number,
    with_options,
)
from memfit.spec import TRAINED_KNOBS, default
from memfit.train.command import refuse_training_settings, training_options

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    help=(
        "memfit: fine-tune LLMs (LoRA, QLoRA, full) on the GPU you have. Start with [bold]memfit plan[/].\n\n"
        "Exit codes: 0 done; 1 doctor found errors; 2 bad input; 3 does not fit (plan, fit, train); "
        "130 / 143 stopped by SIGINT / SIGTERM."
    ),
)
#: The help of plan's and fit's --exact (memfit.planner.shortcuts.switch).
EXACT_HELP = (
    "Plan without shortcuts: every layer simulated, every chunk and micro-batch run, no plan cache "
    "(also MEMFIT_EXACT=1). Slower; the same figures."
)
#: The model `memfit plan` uses when none is given: small enough to plan in a second anywhere.
DEFAULT_MODEL = "smollm2-135m"
#: A plan that takes longer than this shows a status line on a terminal until it is printed.
PLAN_STATUS_DELAY_S = 1.0

#: The RunSpec knobs `memfit fit` takes with a meaning of its own (the search holds or restricts
#: them), and that meaning: the options are the knobs' (their flags and the values they take).
FIT_OWN_KNOBS = {
    "batch_size": "Effective batch (sequences per optimizer step; pairs with a preference --objective; completions, "
    "whole groups of --num-generations, with grpo) to keep \\[default: 8; grpo: --num-generations; a tool's "
    "config: its own].",
    "seq_len": f"Sequence length to hold fixed (default {default('seq_len')}, or the model's maximum if smaller).",
    "method": "Only these methods (repeat the option).",
    "precision": "bf16 / fp16: pure 16-bit; bf16-mixed / fp16-mixed: fp32 weights and optimizer states, 16-bit autocast; "
    "fp32 (default: bf16 where the GPU has it).",
    "gpus": "Up to this many GPUs: the fewest that fit are reported, memory per GPU \\[default: 1].",
    "shard": "Sharding across GPUs (default with --gpus 2+: searched).",
}


@app.command("plan", cls=RefusingCommand)
@cli_errors
@with_options(
    knob_options(), first=[command_options("plan", TARGET_OPTIONS + (CONFIG_MODEL,))], refused=training_options
)
def plan_command(
    model: str = typer.Argument(
        DEFAULT_MODEL,
        help="Catalog name (see `memfit models`), a Hugging Face Hub id (org/name: config.json only is fetched), a config.json, a model folder, an Axolotl / LLaMA-Factory / TRL config (docs/interop.md), or memfit's own training YAML.",
    ),
    context_bytes: str | None = typer.Option(
        None, "--context-bytes", metavar="BYTES", help="Override the CUDA context estimate (bytes, 0 to 1 TiB)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    exact: bool = typer.Option(False, "--exact", help=EXACT_HELP),
    full_sim: bool = typer.Option(False, "--full-sim", hidden=True, help="Now --exact."),
    no_cache: bool = typer.Option(
        False,
        "--no-cache",
        help="Make the plan afresh: do not read or write the plan cache (also MEMFIT_PLAN_CACHE=0).",
    ),
    **options: Any,
) -> None:
    """Predict the peak GPU memory of one training step, by category, without a GPU.

    Exit code 0: planned (and fits the --gpu / --budget, if one is given); 2: bad input;
    3: the plan does not fit the --gpu / --budget."""
    refuse_training_settings(options, "plan")  # memfit train's settings: said what they are, not "no such option"
    if full_sim:
        make_console(stderr=True).print("--full-sim is now --exact: planning exactly", highlight=False)
        exact = True
    # Importing torch, building the model and simulating its step take seconds on a busy machine: a
    # terminal is told what is going on once it has taken PLAN_STATUS_DELAY_S (a log gets nothing).
    with StatusLine(
        make_console(stderr=True), f"planning {model}: checking the model and the options", delay_s=PLAN_STATUS_DELAY_S
    ) as status:
        from memfit.planner.api import plan
        from memfit.train.config_plan import is_train_config, plan_train_config

        # --context-bytes is checked by the plan with every other input (the page's /api/plan shares the check).
        if is_train_config(model):  # memfit's own YAML: planned as train plans it
            result = plan_train_config(
                model, context_bytes=whole_number(context_bytes), exact=exact, cache=not no_cache, **options
            )
        else:
            result = plan(
                model,
                context_bytes=whole_number(context_bytes),
                exact=exact,
                cache=not no_cache,
                progress=lambda what: status.update(f"planning {model}: {what}"),
                **options,
            )
    if as_json:
        sys.stdout.write(result.to_json(indent=2) + "\n")
    else:
        result.render(make_console())
    if result.fits is False:
        raise typer.Exit(code=EXIT_DOES_NOT_FIT)


@app.command("fit", cls=RefusingCommand)
@cli_errors
@with_options(
    knob_options(FIT_KNOBS),
    first=[
        command_options("fit", TARGET_OPTIONS + (CONFIG_MODEL,)),
        knob_options(FIT_OWN_KNOBS, help=FIT_OWN_KNOBS, repeatable=("method",)),
    ],
    refused=training_options,
)
def fit_command(
    model: str = typer.Argument(
        DEFAULT_MODEL,
        help="Catalog name, a Hugging Face Hub id (org/name), a config.json, a model folder, an Axolotl / LLaMA-Factory / TRL config, or memfit's own training YAML (its method, batch and length kept).",
    ),
    max_target: Literal["seq-len"] | None = typer.Option(
        None, "--max", help="Show the longest sequence each method fits."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    write: Path | None = typer.Option(
        None,
        "--write",
        help="Write the best configuration as a `memfit train` config, JSON for a .json name, else YAML (a tool's config: the same tool's config, only its memory keys changed).",
    ),
    data: str | None = typer.Option(
        None, "--data", help="Training data for the --write YAML (default: the demo dataset)."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Let --write replace an existing file (never the config or the --data it reads)."
    ),
    no_cache: bool = typer.Option(
        False,
        "--no-cache",
        help="Make every plan afresh: do not read or write the plan cache (also MEMFIT_PLAN_CACHE=0).",
    ),
    exact: bool = typer.Option(
        False, "--exact", help=EXACT_HELP + " One process; no longest sequence predicted from two plans."
    ),
    **options: Any,
) -> None:
    """Find the training configurations that fit a GPU, fastest first (estimated), and the longest sequences.

    Exit code 0: at least one configuration fits; 2: bad input (checked before the search, --write's
    path too); 3: nothing fits."""
    refuse_training_settings(options, "fit")
    from memfit.interop import is_tool_config
    from memfit.planner.search.driver import fit
    from memfit.planner.search.request import FitEvents
    from memfit.train.config_plan import fit_train_config, is_train_config

    train_config = is_train_config(model)  # memfit's own YAML: fitted as train --fit fits it
    tool_config = is_tool_config(model) or train_config
    if write is not None:
        _check_write_path(write, overwrite, model=model, data=data)  # before minutes of search, not after
    if no_cache:
        import os

        from memfit.planner.shortcuts.cache import ENV_SWITCH

        os.environ[ENV_SWITCH] = "0"  # for this process and the search's worker processes, which inherit it
    from memfit.planner.search.report import FitProgress, render_fit

    request = _fit_request(model, options, exact=exact)
    gpu, budget, revision = request.gpu, request.budget, request.revision
    progress = None if as_json else FitProgress(make_console(stderr=True))
    events = FitEvents(progress=progress, plans_expected=progress.expect if progress is not None else None)
    try:
        result = (fit_train_config if train_config else fit)(request, events)
    finally:
        if progress is not None:
            progress.close()
    console = make_console()
    if as_json:
        sys.stdout.write(result.to_json(indent=2) + "\n")
    else:
        render_fit(result, console, focus_max_seq_len=max_target is not None)
    if not result.fits:
        if write is not None:
            make_console(stderr=True).print(f"nothing fits, so nothing was written to {write}", highlight=False)
        raise typer.Exit(code=EXIT_DOES_NOT_FIT)
    if write is not None and tool_config:
        from memfit.interop.writing import write_fitted_config
        from memfit.train.config_plan import write_fitted_train_config

        writer = write_fitted_train_config if train_config else write_fitted_config
        diff = writer(model, result.fits[0].spec, write, overwrite=overwrite)
        if not as_json:
            sys.stdout.write(diff or f"# {write}: no memory key changes\n")
            console.print(f"wrote {write}: {model} with the memory keys of the fastest fit", highlight=False)
    elif write is not None:
        _write_best(result, model, write, data, overwrite, gpu=gpu, budget=budget, revision=revision)
        if not as_json:
            console.print(f"wrote {write}: train it with [bold]memfit train {write}[/]", highlight=False)


def _fit_request(model: str, options: dict[str, Any], *, exact: bool):
    """The search's request from fit's command line (``options``: its knob options, taken)."""
    from memfit.planner.search.request import FitRequest

    revision, gpu, budget, method, model_override = (
        options.pop(name) for name in ("revision", "gpu", "budget", "method", "model_override")
    )
    # Text that is not a whole number goes on to the search's checks, which list it with every other problem.
    batch_size, seq_len, gpus = (whole_number(options.pop(name)) for name in ("batch_size", "seq_len", "gpus"))
    # --gpus 1 is one GPU, as no --gpus is: neither is a knob the search or a config's "given" holds.
    return FitRequest(
        model,
        revision=revision,
        gpu=gpu,
        budget=budget,
        batch_size=batch_size,
        seq_len=seq_len,
        methods=tuple(method) if method else None,
        gpus=None if gpus == 1 else gpus,
        knobs={k: v for k, v in options.items() if v is not None},
        model_override=model_override,
        exact=exact,
    )


def _check_write_path(path: Path, overwrite: bool, *, model: str, data: str | None) -> None:
    """--write must name a file memfit may create (or, with --overwrite, replace), never the model's
    config or the --data it reads."""
    from memfit.files import check_file_writable, check_not_an_input

    inputs = {
        name: given
        for name, given in (("config being fitted", model), ("--data file", data))
        if given and Path(given).expanduser().exists()
    }  # a catalog name or a Hub id is no file of the user's
    check_not_an_input(path, "--write", inputs, overwrite=overwrite)
    if path.exists() and not path.is_dir() and not overwrite:
        raise PathError(f"--write {str(path)!r} exists; choose another file name or pass --overwrite.")
    check_file_writable(path, "--write", make_parents=True)
    if data:
        from memfit.train.data.sources import is_dataset_id

        if not is_dataset_id(data) and not Path(data).expanduser().exists():
            raise PathError(
                f"--data {data!r} does not exist: give a local file or folder, or a Hub dataset id (org/name)."
            )


def _write_best(
    result, model: str, path: Path, data: str | None, overwrite: bool, *, gpu, budget, revision=None
) -> None:
    from memfit.models.hub import is_hub_id
    from memfit.train.config import demo_dataset_path, write_config

    spec = result.fits[0].spec
    model_path = Path(model).expanduser()
    values: dict = {"model": str(model_path.resolve()) if model_path.exists() else model}
    header = f"# Written by `memfit fit`: the fastest configuration that fits {result.gpu['name']}.\n"
    has_weights = model_path.is_dir() and any(model_path.glob("*.safetensors"))
    if is_hub_id(model):  # the weights are on the Hub: memfit train downloads them
        has_weights = True
        if revision:
            values["revision"] = revision
    if not has_weights:
        values["init"] = "random"
        header += (
            "# init: random trains random weights; point model: at your local Hugging Face folder and delete it.\n"
        )
    values["data"] = data or str(demo_dataset_path())
    multi_gpu = spec.get("gpus", 1) > 1  # a multi-GPU fit: train it with torchrun or --nproc
    for key in TRAINED_KNOBS:
        if multi_gpu or key not in ("gpus", "shard"):
            values[key] = spec[key]
    if gpu:
        values["gpu"] = gpu
    if budget:
        values["budget"] = budget
    write_config(values, path, header=header, overwrite=overwrite)


@app.command("models")
@cli_errors
def models_command(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """List the shipped model catalog and GPU catalog."""
    from rich.table import Table

    from memfit.models.catalog import catalog_names, load_catalog_config
    from memfit.models.gpus import load_gpus
    from memfit.units import format_bytes

    models = []
    for name in catalog_names():
        cfg = load_catalog_config(name)
        models.append(
            {
                "name": name,
                "model_type": cfg.get("model_type"),
                "layers": cfg.get("num_hidden_layers"),
                "hidden_size": cfg.get("hidden_size"),
                "vocab_size": cfg.get("vocab_size"),
                "max_position_embeddings": cfg.get("max_position_embeddings"),
            }
        )
    gpus = load_gpus()
    console = make_console()
    if as_json:
        payload = {
            "models": models,
            "gpus": [
                {"name": g.name, "display_name": g.display_name, "memory_bytes": g.memory_bytes, "arch": g.arch}
                for g in gpus.values()
            ],
        }
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return
    table = Table(title="models", title_justify="left")
    # Names are typed back by users: never cut or wrapped, whatever the width (the numbers give way).
    for col in ("name", "type", "layers", "hidden", "vocab", "context"):
        table.add_column(
            col,
            justify="left" if col in ("name", "type") else "right",
            no_wrap=col == "name",
            min_width=max(len(m["name"]) for m in models) if col == "name" else None,
            overflow="fold",  # on a narrow terminal the other columns wrap, never cut with an ellipsis
        )
    for m in models:
        table.add_row(
            m["name"],
            str(m["model_type"]),
            str(m["layers"]),
            str(m["hidden_size"]),
            str(m["vocab_size"]),
            str(m["max_position_embeddings"]),
        )
    console.print(table)
    gtable = Table(title="GPUs", title_justify="left")
    for col in ("name", "card", "memory", "arch", "bf16"):
        gtable.add_column(
            col, no_wrap=col == "name", min_width=max(len(g.name) for g in gpus.values()) if col == "name" else None
        )
    for g in gpus.values():
        gtable.add_row(g.name, g.display_name, format_bytes(g.memory_bytes), g.arch, "yes" if g.supports_bf16 else "no")
    console.print(gtable)
    console.print(
        "[dim]Any causal LM works too: pass a Hugging Face Hub id (org/name), a config.json or a local model folder.[/]"
    )


# Commands implemented next to their API; each module imports its heavy dependencies lazily.
from memfit.infer.command import chat_command, generate_command  # noqa: E402
from memfit.merge.command import merge_command  # noqa: E402
from memfit.train.command import train_command  # noqa: E402
from memfit.ui.command import ui_command  # noqa: E402
from memfit.watch.command import calibrate_command, doctor_command, report_command  # noqa: E402

app.command("train")(train_command)  # each wrapped in cli_errors where it is defined
app.command("merge")(merge_command)
app.command("doctor")(doctor_command)
app.command("calibrate")(calibrate_command)
app.command("report")(report_command)
app.command("chat")(chat_command)
app.command("generate")(generate_command)
app.command("ui")(ui_command)


#: Library loggers whose warnings say nothing to someone running memfit: bitsandbytes' CPU backend
#: looks for an optional fused kernel package at import on CPUs with AVX512-BF16 and warns when it
#: is missing; memfit's CPU work (demo training, tests) does not use it.
_QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)


def main() -> NoReturn:
    """Console-script entry point. The process ends as soon as the command is done
    (:func:`memfit.exits.end_process`: exit handlers run, no teardown of torch's modules)."""
    import logging

    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    collect_less()
    try:
        app()
    except SystemExit as done:
        end_process(done.code)
    end_process(0)


if __name__ == "__main__":  # pragma: no cover
    main()

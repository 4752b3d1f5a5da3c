"""The ``memfit`` command line: parse, call the Python API, render. No logic lives here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, Optional

import typer
from rich.console import Console

from memfit.options import knob_options, with_options
from memfit.spec import TRAINED_KNOBS, choices

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    help="memfit: fine-tune LLMs (LoRA, QLoRA, full) on the GPU you have. Start with [bold]memfit plan[/].",
)
console = Console()
err_console = Console(stderr=True)

#: The model `memfit plan` uses when none is given: small enough to plan in a second anywhere.
DEFAULT_MODEL = "smollm2-135m"


def _fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code=2)


@app.command("plan")
@with_options(knob_options())
def plan_command(
    model: str = typer.Argument(DEFAULT_MODEL, help="Catalog name (see `memfit models`), a Hugging Face Hub id (org/name: config.json only is fetched), a config.json, or a model folder."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch, tag or commit of a Hub id (default: main)."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU to check against (see `memfit models`)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget instead of a GPU, e.g. 24GiB."),
    context_bytes: Optional[int] = typer.Option(None, "--context-bytes", help="Override the CUDA context estimate."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    full_sim: bool = typer.Option(False, "--full-sim", help="Simulate every layer instead of extrapolating."),
    **knobs: Any,
) -> None:
    """Predict the peak GPU memory of one training step, by category, without a GPU."""
    from memfit.planner.api import PlanError, plan

    try:
        result = plan(model, revision=revision, gpu=gpu, budget=budget, context_bytes=context_bytes, extrapolate=not full_sim, **knobs)
    except PlanError as err:
        _fail("\n".join(["cannot plan this run:"] + [f"  - {p}" for p in err.problems]))
        return
    except ValueError as err:  # model build problems found while simulating
        _fail(str(err))
        return
    if as_json:
        sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
    else:
        result.render(console)


@app.command("fit")
@with_options(knob_options(("rank", "alpha", "dropout", "targets", "recipe")))
def fit_command(
    model: str = typer.Argument(DEFAULT_MODEL, help="Catalog name, a Hugging Face Hub id (org/name), a config.json, or a model folder."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch, tag or commit of a Hub id (default: main)."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU to fit (see `memfit models`)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget instead of a GPU, e.g. 24GiB."),
    batch_size: int = typer.Option(8, "--batch-size", "-b", help="Effective batch (sequences per optimizer step) to keep."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", "-s", help="Sequence length to hold fixed (default 2048)."),
    method: Optional[list[str]] = typer.Option(None, "--method", metavar="|".join(choices("method")), help="Only these methods (repeat the option)."),
    precision: Optional[str] = typer.Option(None, "--precision", metavar="|".join(choices("precision")), help="Weight and compute dtype (default: bf16 where the GPU has it)."),
    gpus: int = typer.Option(1, "--gpus", help="Up to this many GPUs: the fewest that fit are reported, memory per GPU."),
    shard: Optional[str] = typer.Option(None, "--shard", metavar="|".join(choices("shard")), help="Sharding across GPUs (default with --gpus 2+: searched)."),
    max_target: Optional[Literal["seq-len"]] = typer.Option(None, "--max", help="Show the longest sequence each method fits."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    write: Optional[Path] = typer.Option(None, "--write", help="Write the best configuration as a `memfit train` YAML."),
    data: Optional[str] = typer.Option(None, "--data", help="Training data for the --write YAML (default: the demo dataset)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Let --write replace an existing file."),
    **knobs: Any,
) -> None:
    """Find the training configurations that fit a GPU, fastest first (estimated), and the longest sequences."""
    from memfit.planner.api import PlanError
    from memfit.planner.search import fit

    fixed = {k: v for k, v in dict(knobs, precision=precision, shard=shard).items() if v is not None}
    if gpus != 1:
        fixed["gpus"] = gpus
    progress = None if as_json else _status_printer()
    try:
        result = fit(
            model, revision=revision, gpu=gpu, budget=budget, batch_size=batch_size, seq_len=seq_len,
            methods=tuple(method) if method else None, progress=progress, **fixed,
        )
    except PlanError as err:
        _fail("\n".join(["cannot search this model:"] + [f"  - {p}" for p in err.problems]))
        return
    except ValueError as err:
        _fail(str(err))
        return
    finally:
        if progress is not None:
            progress.close()
    if write is not None:
        _write_best(result, model, write, data, overwrite, gpu=gpu, budget=budget, revision=revision)
    if as_json:
        sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
    else:
        from memfit.planner.fit_report import render_fit

        render_fit(result, console, focus_max_seq_len=max_target is not None)
        if write is not None:
            console.print(f"wrote {write}: train it with [bold]memfit train {write}[/]")


def _write_best(result, model: str, path: Path, data: Optional[str], overwrite: bool, *, gpu, budget, revision=None) -> None:
    from memfit.models.hub import is_hub_id
    from memfit.train.config import ConfigError, write_config

    if not result.fits:
        _fail("nothing fits, so there is no configuration to write")
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
        header += "# init: random trains random weights; point model: at your local Hugging Face folder and delete it.\n"
    values["data"] = data or str(_demo_dataset())
    multi_gpu = spec.get("gpus", 1) > 1  # a multi-GPU fit: train it with torchrun or --nproc
    for key in TRAINED_KNOBS:
        if multi_gpu or key not in ("gpus", "shard"):
            values[key] = spec[key]
    if gpu:
        values["gpu"] = gpu
    if budget:
        values["budget"] = budget
    try:
        write_config(values, path, header=header, overwrite=overwrite)
    except ConfigError as err:
        _fail("\n".join([f"cannot write {path}:"] + [f"  - {p}" for p in err.problems]))


def _demo_dataset() -> Path:
    """The demo dataset installed with the package (memfit/assets/data/tiny-instruct.jsonl): the
    written config must work without a source checkout."""
    from importlib import resources

    return Path(str(resources.files("memfit") / "assets" / "data" / "tiny-instruct.jsonl"))


class _status_printer:
    """One updating status line for long searches (Rich status on the error console)."""

    def __init__(self) -> None:
        self.count = 0
        self._status = err_console.status("planning...")
        self._status.start()

    def __call__(self, message: str) -> None:
        self.count += 1
        self._status.update(f"plan {self.count}: {message}")

    def close(self) -> None:
        self._status.stop()


@app.command("models")
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
    if as_json:
        payload = {
            "models": models,
            "gpus": [{"name": g.name, "display_name": g.display_name, "memory_bytes": g.memory_bytes, "arch": g.arch} for g in gpus.values()],
        }
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return
    table = Table(title="models", title_justify="left")
    for col in ("name", "type", "layers", "hidden", "vocab", "max positions"):
        table.add_column(col, justify="left" if col in ("name", "type") else "right")
    for m in models:
        table.add_row(m["name"], str(m["model_type"]), str(m["layers"]), str(m["hidden_size"]), str(m["vocab_size"]), str(m["max_position_embeddings"]))
    console.print(table)
    gtable = Table(title="GPUs", title_justify="left")
    for col in ("name", "card", "memory", "arch", "bf16"):
        gtable.add_column(col)
    for g in gpus.values():
        gtable.add_row(g.name, g.display_name, format_bytes(g.memory_bytes), g.arch, "yes" if g.supports_bf16 else "no")
    console.print(gtable)
    console.print("[dim]Any causal LM works too: pass a Hugging Face Hub id (org/name), a config.json or a local model folder.[/]")


# Commands implemented next to their API; each module imports its heavy dependencies lazily.
from memfit.merge.command import merge_command  # noqa: E402
from memfit.train.command import train_command  # noqa: E402
from memfit.watch.command import doctor_command, report_command  # noqa: E402

app.command("train")(train_command)
app.command("merge")(merge_command)
app.command("doctor")(doctor_command)
app.command("report")(report_command)


#: Library loggers whose warnings say nothing to someone running memfit: bitsandbytes' CPU backend
#: looks for an optional fused kernel package at import on CPUs with AVX512-BF16 and warns when it
#: is missing; memfit's CPU work (demo training, tests) does not use it.
_QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)


def main() -> None:
    """Console-script entry point."""
    import logging

    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

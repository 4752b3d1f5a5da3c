"""The ``memfit`` command line: parse, call the Python API, render. No logic lives here."""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Optional

import typer
from rich.console import Console

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


class Method(str, Enum):
    full = "full"
    lora = "lora"
    qlora = "qlora"


class Precision(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Optimizer(str, Enum):
    adamw = "adamw"
    adamw8bit = "adamw8bit"
    paged_adamw8bit = "paged-adamw8bit"
    sgd = "sgd"


class Checkpointing(str, Enum):
    off = "off"
    on = "on"
    offload = "offload"


def _fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code=2)


@app.command("plan")
def plan_command(
    model: str = typer.Argument(DEFAULT_MODEL, help="Catalog name (see `memfit models`), a config.json, or a model folder."),
    method: Method = typer.Option(Method.lora, help="Fine-tuning method."),
    rank: int = typer.Option(16, help="LoRA rank (lora, qlora)."),
    alpha: Optional[float] = typer.Option(None, help="LoRA alpha (default: 2 x rank)."),
    targets: str = typer.Option("all-linear", help="Comma-separated module names for LoRA, or all-linear."),
    precision: Precision = typer.Option(Precision.bf16, help="Weight and compute dtype."),
    optimizer: Optimizer = typer.Option(Optimizer.adamw, help="Optimizer."),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="Micro-batch size per GPU."),
    seq_len: int = typer.Option(2048, "--seq-len", "-s", help="Tokens per sequence."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    checkpointing: Checkpointing = typer.Option(Checkpointing.on, help="Activation checkpointing."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU to check against (see `memfit models`)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget instead of a GPU, e.g. 24GiB."),
    context_bytes: Optional[int] = typer.Option(None, "--context-bytes", help="Override the CUDA context estimate."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    full_sim: bool = typer.Option(False, "--full-sim", help="Simulate every layer instead of extrapolating."),
) -> None:
    """Predict the peak GPU memory of one training step, by category, without a GPU."""
    from memfit.planner.api import PlanError, plan

    try:
        result = plan(
            model,
            gpu=gpu,
            budget=budget,
            context_bytes=context_bytes,
            extrapolate=not full_sim,
            method=method.value,
            rank=rank,
            alpha=alpha,
            targets=targets,
            precision=precision.value,
            optimizer=optimizer.value,
            batch_size=batch_size,
            seq_len=seq_len,
            grad_accum=grad_accum,
            checkpointing=checkpointing.value,
        )
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


@app.command("models")
def models_command(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """List the shipped model catalog and GPU catalog."""
    from rich.table import Table

    from memfit.models.catalog import catalog_names, load_catalog_config
    from memfit.models.gpus import load_gpus
    from memfit.planner.runtime import format_bytes

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
    console.print("[dim]Any causal LM works too: pass a config.json or a local model folder.[/]")


# Commands implemented next to their API; each module imports its heavy dependencies lazily.
from memfit.merge.command import merge_command  # noqa: E402
from memfit.train.command import train_command  # noqa: E402

app.command("train")(train_command)
app.command("merge")(merge_command)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

"""`memfit train`: the command-line face of :func:`memfit.train.loop.train`.

Importing this module imports neither torch nor transformers, so the CLI starts fast. Exit codes:
0 finished, 2 bad configuration or input, 3 the run does not fit (preflight refusal or out of
memory, with a checkpoint to resume from), 128 + signal number after SIGINT (130) / SIGTERM (143)
once the checkpoint is saved.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated, Any, Optional

import typer


def parse_set_options(items: list[str]) -> dict[str, Any]:
    """``["lr=1e-4", "targets=[q_proj, v_proj]"]`` -> ``{"lr": 1e-4, "targets": ["q_proj", "v_proj"]}``
    (values are read as YAML)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. --set warmup_steps=20")
        parsed = yaml.safe_load(value) if value.strip() else None
        if isinstance(parsed, str):
            try:  # YAML 1.1 reads 1e-4 (no dot) as a string
                parsed = float(parsed)
            except ValueError:
                pass
        out[key.strip().replace("-", "_")] = parsed
    return out


def train_command(
    config: Annotated[Path, typer.Argument(help="YAML training config (see docs/train.md; examples/tiny.yaml is a demo).", show_default=False)],
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in output_dir from its latest checkpoint.")] = False,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate.")] = None,
    epochs: Annotated[Optional[float], typer.Option("--epochs", help="Passes over the data.")] = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", help="Optimizer steps (instead of epochs).")] = None,
    method: Annotated[Optional[str], typer.Option("--method", help="full, lora or qlora.")] = None,
    precision: Annotated[Optional[str], typer.Option("--precision", help="bf16, fp16 or fp32.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", "-b", help="Micro-batch size.")] = None,
    grad_accum: Annotated[Optional[int], typer.Option("--grad-accum", help="Micro-batches per optimizer step.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", "-s", help="Most tokens in one example.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = None,
    output_dir: Annotated[Optional[Path], typer.Option("--output-dir", "-o", help="Run folder (default runs/<config name>).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed.")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="GPU to plan against before loading.")] = None,
    budget: Annotated[Optional[str], typer.Option("--budget", help="Memory budget to plan against, e.g. 20GiB.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Train even when the plan says the run does not fit.")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Any other config field: --set KEY=VALUE (repeatable).")] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No live progress bar (metrics still go to metrics.jsonl).")] = False,
) -> None:
    """Fine-tune a model as a YAML config says: plan first, then train, checkpoint and save the adapter."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)

    def fail(message: str, code: int) -> None:
        console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
        raise typer.Exit(code=code)

    from memfit.train.config import ConfigError, load_config

    try:
        overrides = parse_set_options(set_ or [])
        overrides.update(
            lr=lr, epochs=epochs, max_steps=max_steps, method=method, precision=precision, batch_size=batch_size,
            grad_accum=grad_accum, seq_len=seq_len, device=device, seed=seed, gpu=gpu, budget=budget,
            output_dir=str(output_dir) if output_dir is not None else None, force=True if force else None,
        )
        cfg = load_config(config, overrides)
    except (ConfigError, ValueError) as err:
        fail(str(err), 2)
        return

    _quiet_library_notices()
    from memfit.train.data import DataError
    from memfit.train.loading import LoadError, SetupError
    from memfit.train.loop import OutOfMemory, TrainError, train
    from memfit.train.preflight import PreflightError

    try:
        result = train(cfg, resume=resume, console=console, progress=not no_progress)
    except PreflightError as err:
        err.plan.render(console)
        fail(f"preflight: {err}", 3)
        return
    except OutOfMemory as err:
        fail(str(err), 3)
        return
    except (TrainError, DataError, LoadError, SetupError, ConfigError) as err:
        fail(str(err), 2)
        return

    if result.status == "interrupted":
        console.print(
            f"[yellow]stopped[/] by {result.signal_name} after step {result.step} of {result.total_steps}; "
            f"checkpoint {result.checkpoint}. Continue with: memfit train {config} --resume",
            highlight=False,
        )
        raise typer.Exit(code=128 + int(getattr(signal, result.signal_name or "SIGINT")))
    last = result.losses[-1][1] if result.losses else float("nan")
    first = result.losses[0][1] if result.losses else float("nan")
    evals = f", eval loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
    rate = f", {result.tokens_per_second:.0f} tokens/s" if result.tokens_per_second else ""
    console.print(
        f"[green]done[/]: {result.step} steps, loss {first:.4f} -> {last:.4f}{evals}{rate}\n"
        f"  output  {result.output_dir}\n  metrics {result.run_dir / 'metrics.jsonl'}\n  run     {result.run_dir / 'run.json'}",
        highlight=False,
    )


def _quiet_library_notices() -> None:
    """Hide transformers' deprecation notices about method names: they are for library authors."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.* is deprecated", category=FutureWarning)

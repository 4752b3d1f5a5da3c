"""`memfit merge`: the command line face of `memfit.merge.merge`.

Importing this module imports neither torch nor transformers, so the CLI starts fast. Errors are
printed by :func:`memfit.errors.cli_errors`, which wraps the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from memfit.errors import cli_errors
from memfit.options import REVISION

BaseRevision = REVISION.annotated("merge")


@cli_errors
def merge_command(
    base: Annotated[
        str,
        typer.Option(
            "--base",
            help="Base model folder (config.json + model.safetensors, or shards + model.safetensors.index.json), or a Hugging Face Hub id (org/name).",
            show_default=False,
        ),
    ],
    adapter: Annotated[
        str,
        typer.Option(
            "--adapter",
            help="PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), or a Hub id.",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out", help="Folder to write the merged checkpoint to (must be outside --base).", show_default=False
        ),
    ],
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype", help="Output dtype for float tensors: bf16, fp16 or fp32. Default: keep the base's dtype."
        ),
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="Where to compute the LoRA products: cpu, cuda or cuda:N.")
    ] = "cpu",
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace an earlier merge in --out (only a folder memfit merge wrote, holding nothing else); the old content is deleted only after the new merge is complete.",
        ),
    ] = False,
    safe: Annotated[
        bool, typer.Option("--safe", help="Check every merged tensor is finite and stop at the first that is not.")
    ] = False,
    revision: BaseRevision = None,
    adapter_revision: Annotated[
        str | None, typer.Option("--adapter-revision", help="Branch, tag or commit of a Hub --adapter (default: main).")
    ] = None,
    allow_pickle_weights: Annotated[
        bool,
        typer.Option(
            "--allow-pickle-weights",
            help="Accept a Hub repo whose only weights are pickled .bin files (pickles can run code: trust the repo); they are converted to safetensors once.",
        ),
    ] = False,
) -> None:
    """Merge a LoRA adapter into its base model, one shard at a time, into a Hugging Face checkpoint folder.

    Exit code 0: merged; 2: bad input (nothing is written to --out)."""
    from rich.markup import escape

    from memfit.console import make_console

    from .dtypes import parse_dtype

    console = make_console(stderr=True)
    parse_dtype(dtype)  # fail on a typo before importing torch
    from .api import merge

    result = merge(
        base,
        adapter,
        out,
        dtype=dtype,
        device=device,
        overwrite=overwrite,
        safe=safe,
        progress=True,
        revision=revision,
        adapter_revision=adapter_revision,
        allow_pickle_weights=allow_pickle_weights,
    )
    for path in result.removed_leftovers:
        console.print(f"removed {escape(str(path))}: left by an interrupted merge", highlight=False)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    console.print(
        f"[green]merged[/green] {result.merged_tensor_count} tensors"
        + (f", replaced {result.replaced_tensor_count}" if result.replaced_tensor_count else "")
        + f" -> {result.out_dir} ({result.shard_count} shards, {result.output_bytes / 2**30:.2f} GiB, {result.seconds:.1f} s)",
        highlight=False,
    )

"""``memfit chat`` and ``memfit generate``: the command-line faces of :mod:`memfit.infer`.

Importing this module imports neither torch nor transformers, so the CLI starts fast. Every input
is checked before the model is read (the prompts file, ``--out``, the sampling options); errors
are printed by :func:`memfit.errors.cli_errors` (one line, exit code 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from memfit.errors import UserError, cli_errors, listed
from memfit.options import REVISION
from memfit.train.generation import Sampling

_DEFAULTS = Sampling()

# The options both commands take, declared once; named as transformers' generate() names them.
Source = Annotated[
    str,
    typer.Argument(
        help="A memfit run folder (its adapter on its base model), a Hugging Face model folder, or a Hub id (org/name).",
        show_default=False,
    ),
]
Adapter = Annotated[
    str | None, typer.Option("--adapter", help="A PEFT LoRA adapter folder to put on MODEL (not with a run folder).")
]
Device = Annotated[str, typer.Option("--device", help="auto (a GPU if there is one), cpu, cuda or cuda:N.")]
Dtype = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="bf16, fp16 or fp32 for a MODEL (default: its own on a GPU, fp32 on a CPU); a run folder uses its precision.",
    ),
]
Revision = REVISION.annotated("chat")
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="The longest reply, in tokens.")]
MinNewTokens = Annotated[
    int,
    typer.Option(
        "--min-new-tokens", help="The shortest reply, in tokens: the model's end tokens are held back until then."
    ),
]
DoSample = Annotated[
    bool,
    typer.Option(
        "--do-sample/--greedy",
        help="Sample the reply (with --temperature and --top-p) instead of taking the likeliest token each time.",
    ),
]
Temperature = Annotated[float, typer.Option("--temperature", help="Sampling temperature (with --do-sample).")]
TopP = Annotated[
    float,
    typer.Option(
        "--top-p", help="Nucleus sampling: the smallest set of tokens holding this much probability (with --do-sample)."
    ),
]
Seed = Annotated[
    int,
    typer.Option("--seed", help="Random seed of sampling (replies with --do-sample are the same for the same seed)."),
]


def _sampling(max_new_tokens: int, min_new_tokens: int, do_sample: bool, temperature: float, top_p: float) -> Sampling:
    sampling = Sampling(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
    )
    problems = sampling.problems()
    if problems:
        raise UserError(listed("sampling options", problems))
    return sampling


def _load(source: str, adapter: str | None, device: str, dtype: str | None, revision: str | None, seed: int):
    import warnings

    from memfit.infer.loading import load_chat_model

    # PEFT asks transformers about checkpointing by a name transformers now calls deprecated: a
    # notice for library authors, not for someone talking to a model.
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.* is deprecated", category=FutureWarning)

    chat_model = load_chat_model(source, adapter=adapter, device=device, dtype=dtype, revision=revision)
    import torch

    torch.manual_seed(seed)
    return chat_model


@cli_errors
def chat_command(
    source: Source,
    adapter: Adapter = None,
    system: Annotated[str | None, typer.Option("--system", help="A system prompt, kept by /reset.")] = None,
    image: Annotated[
        list[Path] | None,
        typer.Option("--image", help="A picture shown with the first message (vision-language models; repeatable)."),
    ] = None,
    device: Device = "auto",
    dtype: Dtype = None,
    revision: Revision = None,
    max_new_tokens: MaxNewTokens = _DEFAULTS.max_new_tokens,
    min_new_tokens: MinNewTokens = _DEFAULTS.min_new_tokens,
    do_sample: DoSample = _DEFAULTS.do_sample,
    temperature: Temperature = _DEFAULTS.temperature,
    top_p: TopP = _DEFAULTS.top_p,
    seed: Seed = 0,
) -> None:
    """Talk with a trained model in the terminal, with its chat template; replies are streamed as they come.

    /reset starts the conversation again, /exit (or Ctrl-D) ends it. Exit code 0: ended; 2: bad input
    (no adapter in the run folder, a base model that is not here, an adapter for another model)."""
    from memfit.infer.chat import run_chat

    sampling = _sampling(max_new_tokens, min_new_tokens, do_sample, temperature, top_p)
    if system is not None and not system.strip():
        raise UserError("--system is empty; write the system prompt, or leave the option out")
    for path in image or []:
        if not path.is_file():
            raise UserError(f"--image {str(path)!r} does not exist; pass the path of a picture (PNG, JPEG...)")
    chat_model = _load(source, adapter, device, dtype, revision, seed)
    if image and chat_model.processor is None:
        raise UserError(f"--image: {source} is a text model; it cannot see pictures. Leave --image out")
    images = [str(path) for path in image or []]
    raise typer.Exit(code=run_chat(chat_model, sampling, system=system, images=images))


@cli_errors
def generate_command(
    source: Source,
    prompts: Annotated[
        Path,
        typer.Option(
            "--prompts",
            help="JSONL file: one prompt a line (a JSON string, or an object with prompt or messages).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path,
        typer.Option("--out", help="JSONL file to write: the same records with generation added.", show_default=False),
    ],
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace --out if it exists (never the --prompts file).")
    ] = False,
    adapter: Adapter = None,
    device: Device = "auto",
    dtype: Dtype = None,
    revision: Revision = None,
    max_new_tokens: MaxNewTokens = _DEFAULTS.max_new_tokens,
    min_new_tokens: MinNewTokens = _DEFAULTS.min_new_tokens,
    do_sample: DoSample = _DEFAULTS.do_sample,
    temperature: Temperature = _DEFAULTS.temperature,
    top_p: TopP = _DEFAULTS.top_p,
    seed: Seed = 0,
) -> None:
    """Generate a reply to every prompt of a JSONL file, with the model's chat template (greedy by default).

    Exit code 0: written; 2: bad input (checked before the model is read; nothing is written)."""
    from memfit.console import make_console
    from memfit.infer.batch import check_out, generate_file, read_prompts

    sampling = _sampling(max_new_tokens, min_new_tokens, do_sample, temperature, top_p)
    items = read_prompts(prompts)
    check_out(out, overwrite, {"--prompts file": prompts, "model": source, "--adapter": adapter})
    chat_model = _load(source, adapter, device, dtype, revision, seed)
    console = make_console(stderr=True)

    def progress(done: int, total: int) -> None:
        console.print(f"{done}/{total} prompts", highlight=False)

    count = generate_file(chat_model, items, out, sampling, progress, prompts.parent)
    console.print(f"[green]wrote[/] {count} replies to {out}", highlight=False)

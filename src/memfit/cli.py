"""memfit command line (placeholder while the commands are written)."""

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="memfit: fine-tune LLMs on the GPU you have.")


@app.callback()
def _root() -> None:
    """memfit: fine-tune LLMs on the GPU you have."""


def main() -> None:
    app()

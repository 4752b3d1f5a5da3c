"""``memfit.ui``: the planner as a local web page (``memfit ui``).

A small Starlette server over the same Python API as the command line: the page's form is built
from RunSpec's declarations (:mod:`memfit.ui.form`), its JSON API reads the command line's option
names (:mod:`memfit.ui.params`) and answers with the command line's ``--json`` output
(:mod:`memfit.ui.service`), and its charts are drawn in the browser by a vendored Chart.js
(``static/vendor``: the page works offline).

Beside the CLI at the top of the layers: may import everything below (train, watch, planner,
models, spec and the small utilities), never the CLI, which imports it to register the command.
"""

from __future__ import annotations

__all__ = ["create_app", "PlannerService"]


def __getattr__(name: str):
    if name == "create_app":
        from memfit.ui.app import create_app

        return create_app
    if name == "PlannerService":
        from memfit.ui.service import PlannerService

        return PlannerService
    raise AttributeError(f"module 'memfit.ui' has no attribute {name!r}")

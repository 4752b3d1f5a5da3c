"""The errors of the planner: bad input (every problem with the model, the knobs, the GPU or the budget),
and a search stopped before its end."""

from __future__ import annotations

from memfit.spec import SpecError


class PlanError(SpecError):
    """Bad input for a plan (model, knobs, GPU or budget); every problem is listed."""

    heading = "cannot plan this run"

    def __init__(self, problems: list[str], heading: str | None = None):
        if heading is not None:
            self.heading = heading
        super().__init__(problems)


class SearchCancelled(Exception):
    """A search stopped before its end because its caller asked it to (``FitEvents.stop``): a server
    shutting down. Not the user's mistake, and nothing to report but that it stopped."""

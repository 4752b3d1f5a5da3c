"""One switch turns every shortcut off: the exact plan.

Each shortcut of this package gives the plan the exact simulation gives, and tests compare them
(tests/planner/shortcuts/test_shortcuts.py). An exact plan takes none of them, to check one, or
to plan without trusting any: no replay (every chunk, every micro-batch and every region runs), every
decoder layer simulated (no depth extrapolation), no length model, no plan cache and no stores of
the memo (neither read nor written), no worker processes. ``memfit plan --exact`` and
``memfit fit --exact``, ``memfit.plan(..., exact=True)`` and ``fit(..., exact=True)``, or
``MEMFIT_EXACT=1`` for everything a process plans (its worker processes inherit it).
"""

from __future__ import annotations

import os

from memfit.errors import UserError, shown

#: The environment variable that makes every plan exact: ``MEMFIT_EXACT=1`` (also ``true``, ``yes``, ``on``).
ENV_SWITCH = "MEMFIT_EXACT"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def exact_wanted(exact: bool = False) -> bool:
    """Whether a plan is made exact: asked for (``exact``), or by :data:`ENV_SWITCH`.

    Raises:
        UserError: :data:`ENV_SWITCH` holds something that is neither on nor off.
    """
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value not in _ON + _OFF:
        raise UserError(
            f"{ENV_SWITCH}={shown(os.environ[ENV_SWITCH])}: set it to 1 (or true, yes, on) to make every plan "
            f"exact, or to 0 (false, no, off) or leave it unset for plans with shortcuts."
        )
    return bool(exact) or value in _ON

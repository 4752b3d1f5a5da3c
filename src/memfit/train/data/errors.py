"""The one error type of the data pipeline and the collector that builds it.

Validation walks every record and keeps going after the first problem, so a user fixes a file in one
pass instead of one error per run. The message lists each problem as ``file, location: field:
what is wrong`` (a single problem is that one line).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.errors import UserError

MAX_LISTED_PROBLEMS = 20


class DataError(UserError, ValueError):
    """Training data that cannot be used as it is. The message lists every problem found (up to
    :data:`MAX_LISTED_PROBLEMS`), each with its file, record location and field."""


@dataclass
class Problems:
    """Collects problems during one validation pass; :meth:`raise_if_any` raises them as one error."""

    max_listed: int = MAX_LISTED_PROBLEMS
    listed: list[str] = field(default_factory=list)
    count: int = 0

    def add(self, where: str, message: str, field_name: str | None = None) -> None:
        """Record one problem. ``where`` names the file and record (``data.jsonl, line 3``),
        ``field_name`` the field (``messages[1].role``) when the problem belongs to one."""
        self.count += 1
        if len(self.listed) < self.max_listed:
            prefix = f"{where}: {field_name}: " if field_name else f"{where}: "
            self.listed.append(prefix + message)

    def __bool__(self) -> bool:
        return self.count > 0

    def raise_if_any(self, what: str = "the training data") -> None:
        """Raise the problems as one :class:`DataError`: one problem as its own line (it names its
        file, record and field), several as a list under a line that counts them."""
        if not self.count:
            return
        if self.count == 1:
            raise DataError(self.listed[0])
        noun = "problem" if self.count == 1 else "problems"
        lines = [f"found {self.count} {noun} in {what}:"]
        lines += [f"  - {p}" for p in self.listed]
        if self.count > len(self.listed):
            lines.append(f"  ... and {self.count - len(self.listed)} more not listed")
        raise DataError("\n".join(lines))

"""``to_dict()`` and ``to_json()`` for memfit's result objects, named as pydantic names them.

A result object (a plan, a fit, a finding...) defines ``to_dict()``, its JSON-ready dict, and
inherits :class:`JsonForm`, whose ``to_json(indent=None)`` is that dict as JSON text, as
``model_dump()`` and ``model_dump_json()`` are in pydantic.

``to_json()`` used to return the dict. The text it returns now is a :class:`JsonText`: a ``str``
in every way, which also answers the dict-style reads old code makes (``["fits"]``, ``.get``,
``.keys``, ``.values``, ``.items``, ``== {...}``) from the dict, with a ``DeprecationWarning``
saying to call ``to_dict()``. ``in``, iteration and ``len`` stay a string's (``"fits" in text`` is
a substring test), and ``json.dumps(obj.to_json())`` now encodes a string: use ``to_dict()`` there.
"""

from __future__ import annotations

import json
import warnings
from typing import Any


class JsonText(str):
    """JSON text that old dict-style code can still read, with a DeprecationWarning (see the module)."""

    def __new__(cls, text: str, data: dict[str, Any] | None = None, owner: str = "to_json()") -> JsonText:
        self = super().__new__(cls, text)
        self._data = data
        self._owner = owner
        return self

    def _as_dict(self, how: str) -> dict[str, Any]:
        warnings.warn(
            f"{self._owner} returns JSON text (a str) now; reading it as a dict ({how}) is deprecated and will stop "
            "working: call to_dict() for the dict.",
            DeprecationWarning,
            stacklevel=3,
        )
        if getattr(self, "_data", None) is None:  # a copy made by pickle or copy: the text is the truth
            self._data = json.loads(str(self))
        return self._data

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return str.__getitem__(self, key)
        return self._as_dict(f"[{key!r}]")[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._as_dict(".get()").get(key, default)

    def keys(self):
        return self._as_dict(".keys()").keys()

    def values(self):
        return self._as_dict(".values()").values()

    def items(self):
        return self._as_dict(".items()").items()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, dict):
            return self._as_dict("== a dict") == other
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = str.__hash__


class JsonForm:
    """A result object's JSON forms: subclasses define :meth:`to_dict`; :meth:`to_json` follows."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (plain types only)."""
        raise NotImplementedError

    def to_json(self, *, indent: int | None = None) -> str:
        """:meth:`to_dict` as JSON text (``json.dumps``; ``indent`` as there)."""
        data = self.to_dict()
        return JsonText(json.dumps(data, indent=indent), data, owner=f"{type(self).__name__}.to_json()")

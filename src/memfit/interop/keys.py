"""The records of a key map: what memfit does with each key of another tool's config.

A tool's key map (:mod:`memfit.interop.axolotl`, :mod:`~memfit.interop.llamafactory`,
:mod:`~memfit.interop.hf`) is a table of :class:`Rule` records, one per memfit knob or per thing
memfit does not model, and a list of the tool's keys that do not decide memory. The reader
(:mod:`memfit.interop.reading`) applies the table; ``docs/interop.md`` is generated from it
(:mod:`memfit.interop.docs`). Adding a knob to memfit that a key already names needs no change
here: a rule whose ``knob`` memfit does not have yet reports the key as not modelled, with its
``unmodelled`` reason, until the knob exists.

Values are read with small converters (:func:`as_int`, :func:`as_bool`...) that raise
:class:`ValueError` with the line a user needs (value, what it should be); the reader adds the key
and the file. A value a tool accepts but memfit cannot plan as it is comes back as :class:`Planned`:
the knob value planned instead and why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memfit.json_form import JsonForm

#: A key absent from the config: the rule sees this, not None (None is a value YAML can hold).
ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "ABSENT", "__bool__": lambda self: False})()


@dataclass(frozen=True)
class Planned:
    """A value memfit plans as another: ``value`` is planned (None: the knob's default), and ``why``
    says what differs. ``modelled`` False: the key's effect is not in the plan (listed as not
    modelled); True: it is, approximately (listed as an approximation)."""

    value: Any
    why: str
    modelled: bool = False
    key: str | None = None  # the key to name, when it is not the rule's first (a default's key, say)


@dataclass(frozen=True)
class Rule:
    """Keys of a tool's config and what memfit does with them.

    ``resolve`` gets the config's values of ``keys`` (``ABSENT`` for a key not set) and the reading
    context (:class:`memfit.interop.reading.Context`: the knobs resolved by the rules before it, the
    config's folder), and returns the value of memfit knob ``knob``: a plain value, a
    :class:`Planned` one, or None when the keys leave the knob as it is. A bad value raises
    :class:`ValueError`; :class:`KeyProblem` when the message should name another key than the
    rule's first. A rule without ``knob``
    models nothing: when ``matters`` says its values decide memory, the keys are reported as not
    modelled, with ``unmodelled``. ``write`` maps a knob value back to the tool's keys (``memfit fit
    --write``): a dict of key to new value; None where the knob cannot be written in this tool.
    ``doc`` says what memfit does with the keys, in ``docs/interop.md``.
    """

    keys: tuple[str, ...]
    knob: str | None = None
    resolve: Callable[[Mapping[str, Any], Any], Any] | None = None
    write: Callable[[Any, Mapping[str, Any]], dict[str, Any]] | None = None
    unmodelled: str = ""
    matters: Callable[[Mapping[str, Any]], bool] | None = None
    doc: str = ""


def not_modelled(*names: str, why: str, when: Callable[[Any], bool] | None = None, knob: str | None = None) -> Rule:
    """Keys that decide memory and that memfit does not model: reported with ``why`` when set to a
    value ``when`` accepts (default: any value that is not false, empty or null). With ``knob``: a
    knob memfit is to have; once it does, the key sets it (one key, its value as it is)."""
    test = when or truthy

    def matters(values: Mapping[str, Any]) -> bool:
        return any(values[n] is not ABSENT and test(values[n]) for n in names)

    resolve = None
    if knob is not None:
        resolve = lambda values, ctx: values[names[0]] if values[names[0]] is not ABSENT else None  # noqa: E731
    return Rule(tuple(names), knob, resolve, unmodelled=why, matters=matters, doc=why)


class KeyProblem(ValueError):
    """A bad value of ``key`` (a rule reading several keys says which one is wrong)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


def value_of(values: Mapping[str, Any], name: str, read: Callable[[Any], Any], default: Any = ABSENT) -> Any:
    """``read`` of key ``name``'s value (``default`` when absent, returned as it is); a bad value
    raises :class:`KeyProblem` naming ``name``."""
    value = values[name]
    if value is ABSENT:
        return default
    try:
        return read(value)
    except KeyProblem:
        raise
    except ValueError as err:
        raise KeyProblem(name, str(err)) from None


def truthy(value: Any) -> bool:
    """Whether a config value turns something on: not false, 0, empty, null or the text "false"."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "no", "none", "null", "0", "off")
    return bool(value)


# ------------------------------------------------------------------------------------------------
# Converters: the value as written -> the value memfit takes, or a ValueError saying what is wrong.


def as_int(value: Any) -> int:
    """A whole number, 1 or more (YAML may give ``4``, ``4.0`` or ``"4"``; DeepSpeed ``5e8``)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a whole number")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{value!r} is not a whole number") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"{value!r} is not a whole number")
    if value < 1:
        raise ValueError(f"{value} must be 1 or more")
    return value


def as_float(value: Any) -> float:
    """A positive number."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number") from None
    if not number > 0:
        raise ValueError(f"{value!r} must be more than 0")
    return number


def as_bool(value: Any) -> bool:
    """true or false (YAML's spellings, and the strings people write)."""
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0", "none", "null", ""):
            return False
    raise ValueError(f"{value!r} is not true or false")


def as_names(value: Any) -> tuple[str, ...]:
    """Module names: a YAML list, or one comma-separated string."""
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        names = [str(part).strip() for part in value if str(part).strip()]
    else:
        raise ValueError(f"{value!r} is not a list of module names")
    if not names:
        raise ValueError("is empty; name at least one module")
    return tuple(names)


def one_of(choices: Mapping[str, Any], what: str, *, shown: tuple[str, ...] | None = None) -> Callable[[Any], Any]:
    """A converter for a value out of ``choices`` (the tool's spelling -> what memfit plans: a knob
    value or a :class:`Planned`); anything else is an error naming the closest value the tool takes
    (and, for a short list, the values: ``shown``, default the spellings of ``choices``)."""

    def read(value: Any) -> Any:
        text = str(value).strip().lower() if value is not None else "null"
        if text in choices:
            return choices[text]
        names = tuple(shown) if shown is not None else tuple(k for k in choices if k not in ("", "null", "none"))
        raise ValueError(not_one_of(value, names, what))

    return read


def not_one_of(value: Any, names: tuple[str, ...], what: str) -> str:
    """``'dpoo' is not an RL trainer Axolotl knows (dpo, ipo...). Did you mean 'dpo'?``: the value, what
    it should be, the values when they are few, and always the closest of them."""
    import difflib

    text = str(value).strip().lower()
    close = difflib.get_close_matches(text, names, n=1) or difflib.get_close_matches(text, names, n=1, cutoff=0.0)
    listing = f" ({', '.join(names)})" if len(names) <= _LISTED else ""
    return f"{value!r} is not {what}{listing}." + (f" Did you mean {close[0]!r}?" if close else "")


#: Up to this many values a tool takes are listed in a refusal (longer lists: the closest alone).
_LISTED = 16


@dataclass(frozen=True)
class Choices:
    """A key whose value must be one of the names a tool takes (``rl``, ``pref_loss``, ``loss_type``,
    ``lr_scheduler_type``...): a value the tool would refuse is refused, before any rule reads it,
    naming the closest name. Checked whether or not the key decides memory.

    ``names`` are the tool's, as the tool spells them (from ``source``: the tool's file and version);
    a function of the config's values where they depend on the rest of the config (TRL's
    ``loss_type``: SFTConfig's, DPOConfig's or CPOConfig's), returning the names and what they are.
    ``many``: a list of names is taken too. ``also``: other values the tool takes (a Hub kernel's
    path for ``attn_implementation``). ``doc`` says what is taken, in ``docs/interop.md``."""

    key: str
    names: tuple[str, ...] | Callable[[Mapping[str, Any]], tuple[tuple[str, ...], str]]
    what: str = ""
    source: str = ""
    many: bool = False
    also: Callable[[str], bool] | None = None
    doc: str = ""

    def problem(self, raw: Mapping[str, Any]) -> str | None:
        """Why the config's value of :attr:`key` is not one the tool takes (None when it is, or is unset)."""
        value = raw.get(self.key)
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        names, what = self.names(raw) if callable(self.names) else (self.names, self.what)
        values = value if self.many and isinstance(value, (list, tuple)) else [value]
        for item in values:
            text = str(getattr(item, "value", item)).strip()
            if isinstance(item, (bool, int, float, Mapping, list, tuple)) or (
                text.lower() not in names and not (self.also is not None and self.also(text))
            ):
                return f"{self.key}: {not_one_of(item, names, what)}"
        return None

    def described(self) -> str:
        """What the key takes, for ``docs/interop.md``."""
        if self.doc:
            return self.doc
        return f"{', '.join(f'`{n}`' for n in self.names)} ({self.source})"


@dataclass
class Found(JsonForm):
    """What reading one key found that a user should see."""

    key: str
    value: Any
    why: str
    knob: str | None = None  # the knob the finding is about, when a rule setting one found it

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": _plain(self.value), "why": self.why, "knob": self.knob}


def _plain(value: Any) -> Any:
    """A config value as plain JSON (ruamel's and PyYAML's containers included)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass
class KeyMap:
    """One tool's key map: its rules, in the order they resolve, and the keys it knows that do not
    decide memory (everything else is an unknown key, reported once)."""

    tool: str
    title: str
    rules: tuple[Rule, ...]
    quiet_keys: frozenset[str]
    docs_url: str
    #: Chosen for a config with none of any tool's own keys but some of this one's (the Trainer's
    #: arguments are every tool's: a config of nothing else is a plain TrainingArguments one).
    generic: bool = False
    #: Knobs every config of this tool plans with: the Hugging Face step (``recipe: hf``).
    base_knobs: Mapping[str, Any] = field(default_factory=lambda: {"recipe": "hf"})
    #: Keys whose values must be names the tool takes (checked before the rules run).
    choices: tuple[Choices, ...] = ()

    @property
    def memory_keys(self) -> frozenset[str]:
        return frozenset(k for rule in self.rules for k in rule.keys)

    @property
    def all_keys(self) -> frozenset[str]:
        return self.memory_keys | self.quiet_keys

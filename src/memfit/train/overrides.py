"""``model_overrides`` checked before any work: the values transformers refuses, named by their key.

transformers checks a model's config as it builds it (types of fields, that ``hidden_size`` is a
multiple of ``num_attention_heads``, an activation it knows...), some of it in the config class and
some only when the modules are made. :func:`override_problems` does both, cheaply: the config with
the overrides, and one decoder layer of the model on the ``meta`` device (no memory). When that
fails, the overrides to blame are found by building again without each one (and each one alone),
so the message names ``model_overrides.<key>``, its value and transformers' reason, not a traceback
from the middle of model loading.
"""

from __future__ import annotations

from typing import Any

#: Longest reason quoted from transformers (its messages can list every allowed value).
_REASON_CHARS = 300


def override_problems(base: dict[str, Any], overrides: dict[str, Any]) -> list[str]:
    """What transformers refuses in ``overrides`` applied to the model config ``base``: one line
    naming the key(s), the value(s), transformers' reason and the fix, or [] when it builds."""
    if not overrides:
        return []
    reason = build_problem(dict(base, **overrides))
    if reason is None:
        return []
    if build_problem(base) is not None:
        return []  # the model itself does not build: not the overrides' doing, and reported when it loads
    blamed = [key for key in overrides if build_problem(dict(base, **_without(overrides, key))) is None]
    if not blamed:  # no single override is the cause: those that fail on their own are
        blamed = [key for key in overrides if build_problem(dict(base, **{key: overrides[key]})) is not None]
    model_type = base.get("model_type", "this")
    if len(blamed) == 1:
        (key,) = blamed
        return [
            f"model_overrides.{key}: {overrides[key]!r}: transformers refuses it ({reason}). Give {key} a value "
            f"a {model_type} config takes, or remove it from model_overrides."
        ]
    if blamed:
        named = " with ".join(f"model_overrides.{key}: {overrides[key]!r}" for key in blamed)
        return [
            f"{named}: transformers refuses them together ({reason}). Change one so that they agree, or remove "
            "them from model_overrides."
        ]
    return [
        f"model_overrides: transformers cannot build the model with them ({reason}). Check each value against "
        "the model's config.json."
    ]


def build_problem(model_config: dict[str, Any]) -> str | None:
    """Why transformers cannot make the config ``model_config`` and a decoder layer of each kind of
    its model (None when it can): the innermost error's message, in one line."""
    import torch

    from memfit.models.build import build_meta_model, make_config
    from memfit.models.layer_kinds import covering_layers

    try:
        build_meta_model(make_config(model_config, layers=covering_layers(model_config)), torch.float32)
    except Exception as err:  # noqa: BLE001 - transformers' checks raise every kind of error for a bad value
        return _reason(err)
    return None


def _without(overrides: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in overrides.items() if k != key}


def _reason(err: BaseException) -> str:
    """The message of the error at the bottom of ``err``'s chain (transformers wraps its checks'
    errors in its own, and memfit's builder in a ModelBuildError), on one line."""
    seen = set()
    while id(err) not in seen and (err.__cause__ or err.__context__) is not None:
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    text = " ".join(str(err).split())
    if not isinstance(err, (ValueError, TypeError)) or not text:  # KeyError('nope') says little without its type
        text = f"{type(err).__name__}: {text}"
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."

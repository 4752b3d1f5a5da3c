"""The errors every part of ``memfit.models`` raises: a model it cannot build, find or fetch."""

from __future__ import annotations

from memfit.errors import UserError


class ModelBuildError(UserError, ValueError):
    """transformers cannot build a causal LM from this config, or a knob does not fit the model."""


class ModelNotFoundError(UserError, ValueError):
    """The model argument is neither a catalog name nor a readable config."""


class HubError(UserError, ValueError):
    """A Hub id could not be turned into the files a command needs; the message says why and what to do.

    ``kind`` names the problem for callers and tests: ``missing-repo``, ``gated``, ``revision``,
    ``file``, ``network``, ``offline``, ``token``, ``forbidden``, ``http``, ``interrupted``,
    ``corrupt``, ``cache``, ``pickle``, ``no-weights``, ``remote-code``, ``not-hub-id``. ``reason`` is a short
    clause (no fix) used where another message quotes it.
    """

    def __init__(self, message: str, kind: str, reason: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.reason = reason or message

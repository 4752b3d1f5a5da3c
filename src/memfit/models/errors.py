"""The error every part of ``memfit.models`` raises for a model it cannot build or read."""

from __future__ import annotations

from memfit.errors import UserError


class ModelBuildError(UserError, ValueError):
    """transformers cannot build a causal LM from this config, or a knob does not fit the model."""

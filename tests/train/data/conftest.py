"""Fixtures of the data tests: the tiny tokenizer, with and without its chat template."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from memfit.train.data import tiny_tokenizer_path

    return AutoTokenizer.from_pretrained(tiny_tokenizer_path())


@pytest.fixture()
def plain_tokenizer():
    """The tiny tokenizer without its chat template, so the default template is used."""
    from transformers import AutoTokenizer

    from memfit.train.data import tiny_tokenizer_path

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_path())
    tok.chat_template = None
    return tok

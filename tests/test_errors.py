"""memfit.errors: long values in messages are cut, the message around them never is."""

from memfit.errors import LONG_VALUE_CHARS, clip_long_values, shown


def test_a_long_value_is_cut_to_its_start_and_its_length():
    assert clip_long_values("model: '" + "a" * 1000 + "' is not a model") == (
        "model: '" + "a" * 80 + "…' (1,000 characters) is not a model"
    )
    assert clip_long_values("path " + "b" * 300) == "path " + "b" * 80 + "… (300 characters)"


def test_the_words_between_two_short_quoted_values_are_not_a_value():
    choices = ", ".join(["cosine_with_restarts"] * 15)
    message = f"lr_scheduler: 'cosin' is not a scheduler Axolotl knows ({choices}). Did you mean 'cosine'?"
    assert len(message) > LONG_VALUE_CHARS and clip_long_values(message) == message


def test_shown_cuts_a_long_value_whatever_it_holds():
    value = "a b " * 200  # spaces inside and at its end
    assert shown(value) == repr(value)[:81] + "…' (800 characters)"
    assert shown("short ") == "'short '"

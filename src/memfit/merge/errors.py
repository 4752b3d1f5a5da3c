"""The one error type the merge raises for bad input."""

from memfit.errors import UserError


class MergeError(UserError, ValueError):
    """Bad input to `memfit merge`: the message names the field, the value and the fix.

    Raised before anything is written wherever the problem can be seen up front; the command
    line prints it in red and exits with code 2.
    """

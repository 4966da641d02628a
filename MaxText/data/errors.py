"""DataError's home before MaxText/errors.py (where the user-error types now live); it stays importable
from here: `from MaxText.data.errors import DataError`."""

from MaxText.errors import DataError

__all__ = ["DataError"]

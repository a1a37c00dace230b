"""The one error of train/data/."""
from __future__ import annotations

from checkpoint.errors import ShardkitError


class DataError(ShardkitError):
    """A data file, prefix, blend or split cannot be used; the message names the file or flag."""

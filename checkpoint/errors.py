"""One exception family: the CLI prints any ShardkitError as a single line and exits non-zero."""


class ShardkitError(Exception):
    """A user-facing error: the message names the file, tensor or flag and what is wrong."""


class ConfigError(ShardkitError):
    """config.json / model config cannot be honoured."""


class LayoutError(ShardkitError):
    """A parallel layout does not fit the model (e.g. tp does not divide the KV heads)."""


class FormatError(ShardkitError):
    """A checkpoint or source file is malformed, incomplete or inconsistent."""


class CorruptionError(FormatError):
    """Stored bytes fail their checksum, or a chunk is missing."""


class WriteError(ShardkitError):
    """Bytes could not be written (disk full, file too large, read-only): temporary output is removed."""

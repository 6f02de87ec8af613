"""Errors a user can act on. The CLI prints these as one line and exits 2, never as a traceback."""


class StrataError(Exception):
    """Base class: the message names what was wrong and what is allowed."""


class ModelLoadError(StrataError, ValueError):
    """A model directory, file or tensor that cannot be loaded."""


class ConfigError(StrataError, ValueError):
    """A configuration key with a bad value."""

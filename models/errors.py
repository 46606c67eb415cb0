"""Errors raised while finding or loading a model; each message names the file and the problem."""


class ModelLoadError(ValueError):
    """A checkpoint could not be read."""

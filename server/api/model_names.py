"""The names a client may call the served model by.

`--served-model-name` gives one or more names: the first is the model's name in every answer (what
/v1/models lists first and /api/tags shows), the others are aliases, as vLLM's list of served names.
Each is also accepted with Ollama's default tag, `:latest`: /api/tags advertises `<name>:latest`, and a
client that picked the model from that list sends the tagged name to every dialect's routes. Another
tag (`name:7b`) is another model, and is not found.
"""
from __future__ import annotations

from ..config import ServerConfig

LATEST = ":latest"


def parse_names(values: list[str]) -> tuple[str, ...]:
    """--served-model-name, repeated or comma-separated, in order and without repeats."""
    return tuple(dict.fromkeys(n.strip() for v in values for n in v.split(",") if n.strip()))


def served_names(config: ServerConfig) -> tuple[str, ...]:
    """The primary name, then the aliases."""
    return (config.model_name, *(a for a in config.model_aliases if a != config.model_name))


def untagged(model: str) -> str:
    return model[: -len(LATEST)] if model.endswith(LATEST) else model


def resolve(config: ServerConfig, model: str) -> str | None:
    """The served name `model` means (itself, or without its `:latest`), or None if it names no served name."""
    names = served_names(config)
    if model in names:
        return model
    return untagged(model) if untagged(model) in names else None


def tagged(name: str) -> str:
    """A name as Ollama lists it: with a tag, `:latest` if it has none."""
    return name if ":" in name else name + LATEST

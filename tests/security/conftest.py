"""The model most security tests serve: the tiny random Llama (what they test is the server, not the text)."""
import pytest

from models.loader import load_model


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["llama"]))

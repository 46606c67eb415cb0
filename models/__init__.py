"""Model code, checkpoint loaders, tokenizer and export."""
from .catalog import DEFAULT_MODEL, NAMED_MODELS, cache_dir, fetch
from .config import ModelConfig, UnsupportedModel
from .errors import ModelLoadError
from .artifact_save import save_artifact
from .export import LoadedModel, load_artifact
from .loader import load_model
from .tokenizer import TextTokenizer

__all__ = [
    "DEFAULT_MODEL", "NAMED_MODELS", "LoadedModel", "ModelConfig", "ModelLoadError", "TextTokenizer",
    "UnsupportedModel", "cache_dir", "fetch", "load_artifact", "load_model", "save_artifact",
]

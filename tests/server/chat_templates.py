"""SmolLM2's weights and vocabulary under other models' real chat templates (templates/: Qwen3's, Llama
3.2's, Mistral Nemo's), so that the server reads its replies as it reads those models'; and the regex that
makes a reply a given text (guided decoding), since a tiny model writes no think block or call by itself."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from models.tokenizer import TextTokenizer

TEMPLATES = Path(__file__).parent / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
# Qwen3.5's switch: the template itself opens the think block unless thinking is off (as DeepSeek-R1's does)
QWEN3_OPENING = QWEN3.replace("        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}",
                              "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- else %}\n        {{- '<think>\\n' }}\n"
                              "    {%- endif %}")
LLAMA3 = (TEMPLATES / "llama3_2.jinja").read_text()
MISTRAL = (TEMPLATES / "mistral_nemo.jinja").read_text()
assert QWEN3_OPENING != QWEN3

_REGEX_SPECIAL = set("\\.^$|?*+()[]{}")


def with_template(model, template: str):
    """The model with this chat template in place of its own."""
    meta = dataclasses.replace(model.tokenizer.meta, chat_template=template)
    return dataclasses.replace(model, tokenizer=TextTokenizer(model.tokenizer.tokenizer, meta))


def exactly(text: str) -> str:
    """A regex (guided_regex) that matches this text and nothing else."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def oai(server):
    """The OpenAI SDK on a live server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

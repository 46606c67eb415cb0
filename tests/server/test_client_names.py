"""The names clients call the model by, on every dialect's routes: the served name, its aliases
(--served-model-name's later names), each with Ollama's `:latest` (what /api/tags advertises), and the
empty string (vLLM's rule). Ollama's routes take only `:latest` as a tag. Real servers, each dialect's SDK."""
import anthropic
import httpx
import ollama
import openai
import pytest

from server.api.model_names import parse_names
from server.cli import build_parser
from server.config import ServerConfig

from ..live_server import LiveServer

MODEL = "smollm2-135m-instruct"
ALIASES = ("smol", "gpt-4o-mini")
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def aliased(served_model):
    with LiveServer(served_model, server_config=ServerConfig(model_name=MODEL, model_aliases=ALIASES)) as server:
        yield server


def openai_client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_name_api_tags_advertises_works_on_every_dialect(fast_server):
    listed = ollama.Client(host=fast_server.url).list().models[0].model
    assert listed == MODEL + ":latest"
    c = openai_client(fast_server)
    assert c.chat.completions.create(model=listed, messages=HI, max_tokens=1).model == MODEL
    assert c.completions.create(model=listed, prompt="Hi", max_tokens=1).choices[0].text is not None
    assert c.responses.create(model=listed, input="Hi", max_output_tokens=1, store=False).model == MODEL
    assert c.models.retrieve(listed).id == MODEL
    claude = anthropic.Anthropic(base_url=fast_server.url, api_key="unused", max_retries=0)
    assert claude.messages.create(model=listed, max_tokens=1, messages=HI).model == MODEL
    assert claude.messages.count_tokens(model=listed, messages=HI).input_tokens > 0
    assert httpx.post(fast_server.url + "/tokenize", json={"model": listed, "prompt": "Hi"}).status_code == 200
    # vLLM's rule: no name at all is the served model
    assert c.chat.completions.create(model="", messages=HI, max_tokens=1).model == MODEL


def test_aliases_are_listed_and_answered(aliased):
    c = openai_client(aliased)
    assert [m.id for m in c.models.list().data] == [MODEL, *ALIASES]
    assert c.models.retrieve("smol").id == "smol" and c.models.retrieve("smol:latest").id == "smol"
    for name in (*ALIASES, "smol:latest", MODEL + ":latest"):
        r = c.chat.completions.create(model=name, messages=HI, max_tokens=1)
        assert r.model == MODEL  # answers name the model by its primary name
    claude = anthropic.Anthropic(base_url=aliased.url, api_key="unused", max_retries=0)
    assert claude.messages.count_tokens(model="gpt-4o-mini", messages=HI).input_tokens > 0
    assert c.responses.create(model="smol", input="Hi", max_output_tokens=1, store=False).status

    local = ollama.Client(host=aliased.url)
    assert [m.model for m in local.list().models] == [MODEL + ":latest"]  # the primary name only
    for name in ("smol", "smol:latest"):
        assert local.chat(model=name, messages=HI, options={"num_predict": 1}).done
        assert local.show(name).modelinfo
    for name in ("gpt-4o", "smol:7b"):
        with pytest.raises(openai.NotFoundError, match=name):
            c.chat.completions.create(model=name, messages=HI, max_tokens=1)
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.count_tokens(model=name, messages=HI)


@pytest.mark.parametrize("path, body", [
    ("/api/chat", {"messages": HI}),
    ("/api/generate", {"prompt": "Hi"}),
    ("/api/show", {}),
])
def test_ollama_routes_refuse_another_tag_in_ollamas_words(fast_server, path, body):
    for name in (MODEL + ":7b", "llama3"):
        r = httpx.post(fast_server.url + path, json={"model": name, **body})
        assert r.status_code == 404 and r.json() == {"error": f"model '{name}' not found"}, r.text
    r = httpx.post(fast_server.url + path, json={"model": MODEL + ":latest", **body, "options": {"num_predict": 1}}
                   if path != "/api/show" else {"model": MODEL + ":latest"})
    assert r.status_code == 200, r.text


def test_served_model_name_takes_several_names():
    assert parse_names(["a, b", "c", "a"]) == ("a", "b", "c")
    args = build_parser().parse_args(["serve", "--served-model-name", "first,second", "--served-model-name", "third"])
    assert parse_names(args.served_model_name) == ("first", "second", "third")


def test_status_names_the_model_by_its_served_name(tiny_checkpoints):
    from models import load_model

    model = load_model(str(tiny_checkpoints["llama"]))  # its own name is its folder's
    with LiveServer(model, server_config=ServerConfig(model_name="house-model", model_aliases=("other",))) as server:
        assert model.name != "house-model"
        assert httpx.get(server.url + "/v1/status").json()["model"] == "house-model"
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "house-model"

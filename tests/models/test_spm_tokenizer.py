"""GGUF files with a SentencePiece vocabulary (tokenizer.ggml.model "llama": Gemma 3, Llama 2, Mistral, Phi-3)
load and tokenize as llama.cpp does: tiny checkpoints with a SentencePiece model trained here, converted by
llama.cpp's own converter (spm_files), their ids compared with transformers', SentencePiece's and llama-server's."""
import random

import pytest
import torch

from models import UnsupportedModel, load_model
from models.detokenizer import IncrementalDetokenizer
from models.gguf_loader import read_gguf
from models.spm_tokenizer import CONTROL, NORMAL, USER_DEFINED, score_ranked_merges
from models.tokenizer import TextTokenizer
from server.api.chat_template import render

from .gguf_files import rewritten
from .spm_files import CORPUS, TURNS, llama_cpp_tokenizer, llama_server_binary, with_scores, write_spm_checkpoint
from .test_architectures import write_gguf_from_hf
from .test_models import greedy, hf_greedy

TEXTS = [
    "",
    "Hello world",
    "The GNU General Public License is a free, copyleft license for software.",
    " leading space",
    "   three leading",
    "trailing space ",
    "trailing two  ",
    "many     spaces   inside",
    "line one\nline two\n\n\nafter blanks\r\n",
    "\ttabs\tand\n mixed \n ",
    "digits 0123456789, 2007 and 3.14",
    "Café déjà vu, naïve façade",
    "東京と大阪 Привет, мир",
    "emoji 🦙🎉 and ✓ need their bytes",
    "\u00ff\u0100 e\u0301",
    "<start_of_turn>user\nWhat is free software?<end_of_turn>\n<start_of_turn>model\n",
    "a<start_of_turn>b <end_of_turn> c",
    "<eos> then <bos> and <s> then </s>",
    "<unk>",
    "<|end|>\n<|endoftext|> tail",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """kind -> (HF folder, its GGUF by llama.cpp's converter)."""
    root = tmp_path_factory.mktemp("spm")
    out = {}
    for i, kind in enumerate(("gemma3", "llama")):
        folder = write_spm_checkpoint(root / kind, kind, seed=60 + i)
        out[kind] = folder, write_gguf_from_hf(folder, root / f"{kind}.gguf")
    return out


@pytest.fixture(scope="module")
def loaded(files):
    return {kind: read_gguf(gguf)[2] for kind, (_, gguf) in files.items()}


def added_tokens(tok: TextTokenizer) -> list[str]:
    return [t.content for t in tok.tokenizer.get_added_tokens_decoder().values()]


def test_the_files_are_sentencepiece_as_llama_cpp_writes_them(files, loaded):
    import gguf

    for kind, (_, path) in files.items():
        fields = gguf.GGUFReader(str(path)).fields
        assert fields["tokenizer.ggml.model"].contents() == "llama"
        types = dict(zip(fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()))
        assert [types[t] for t in TURNS] == [USER_DEFINED] * 2  # matched whole, and printed when decoding
        assert types["<bos>" if kind == "gemma3" else "<s>"] == CONTROL
        if kind == "gemma3":
            assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
        else:
            assert "tokenizer.ggml.add_space_prefix" not in fields  # llama.cpp's default: true
        tok = loaded[kind]
        assert tok.vocab_size == 1000 and tok.meta.add_bos
        assert set(TURNS) <= set(added_tokens(tok))


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_ids_match_transformers_and_sentencepiece(files, loaded, kind):
    """transformers' GemmaTokenizer gives llama.cpp's ids everywhere. Its LlamaTokenizer and SentencePiece itself
    prepend the space once, to the whole text, where llama.cpp prepends it to each run of text after an added
    token, so they are compared on text without added tokens; and that LlamaTokenizer prepends none to text
    that starts with a space, where SentencePiece and llama.cpp do."""
    import sentencepiece
    import transformers

    folder, _ = files[kind]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tok = loaded[kind]
    specials = added_tokens(tok)
    for text in TEXTS:
        ids = tok.encode(text, add_special=False)
        plain = not any(s in text for s in specials)
        if kind == "gemma3" or plain and not text.startswith(" "):
            assert ids == hf.encode(text, add_special_tokens=False), text
        if plain:
            assert ids == sp.encode(text), text
            assert tok.decode(ids) == text
        assert tok.encode(text) == [tok.bos_id, *ids]
        if kind == "gemma3":  # without a prefix space nothing is lost around the added tokens
            assert tok.decode(ids, skip_special=False) == text


def variant(files, loaded, kind: str, folder) -> tuple:
    """(GGUF, our tokenizer of it) for `kind`: a converted file, or "phi3": the Llama file named as a Phi-3, whose
    special tokens llama.cpp strips the whitespace after, or "shuffled": the Llama file with its normal pieces'
    scores shuffled, so that merges follow scores and not ids."""
    import gguf

    if kind in files:
        return files[kind][1], loaded[kind]
    source = files["llama"][1]
    if kind == "phi3":
        path = rewritten(source, folder / "phi3.gguf", fields={"general.name": "Phi-3 tiny"})
    else:
        fields = gguf.GGUFReader(str(source)).fields
        scores = [float(s) for s in fields["tokenizer.ggml.scores"].contents()]
        normal = [i for i, t in enumerate(fields["tokenizer.ggml.token_type"].contents()) if t == NORMAL]
        values = [scores[i] for i in normal]
        random.Random(0).shuffle(values)
        scores = [*scores]
        for i, v in zip(normal, values):
            scores[i] = v
        path = with_scores(source, folder / "shuffled.gguf", scores)
    return path, read_gguf(path)[2]


@pytest.mark.skipif(llama_server_binary() is None, reason="llama-server is not built (python bench/llama_server.py)")
@pytest.mark.parametrize("kind", ["gemma3", "llama", "phi3", "shuffled"])
def test_ids_match_llama_cpp(files, loaded, kind, tmp_path):
    """llama.cpp's own tokenizer on the same file: every text, and each twice around a newline and spaces."""
    path, tok = variant(files, loaded, kind, tmp_path)
    if kind == "phi3":
        assert tok.encode("<|end|> \n x") == tok.encode("<|end|>x")
        assert tok.encode("<|endoftext|> x") != tok.encode("<|endoftext|>x")
    if kind == "shuffled":
        assert sum(tok.encode(t) != loaded["llama"].encode(t) for t in TEXTS) >= 3  # the test sees the order
    texts = [*TEXTS, *(t + "\n  " + t for t in TEXTS), CORPUS.read_text()]
    with llama_cpp_tokenizer(llama_server_binary(), path) as llama_cpp:
        for text in texts:
            assert tok.encode(text, add_special=False) == llama_cpp(text), text
        for text in TEXTS[:4]:
            assert tok.encode(text) == llama_cpp(text, add_special=True), text


def test_streamed_text_and_saved_tokenizer_agree(loaded, tmp_path):
    """What the server streams (the incremental detokenizer) is the whole decode, emoji bytes and the first
    token's prefix space included; an artifact's saved tokenizer gives the same ids."""
    for kind, tok in loaded.items():
        folder = tmp_path / kind
        folder.mkdir()
        tok.save(folder)
        again = TextTokenizer.load(folder)
        for text in TEXTS:
            ids = tok.encode(text)
            assert again.encode(text) == ids
            detok = IncrementalDetokenizer(tok)
            assert "".join(detok.push(i) for i in ids) + detok.flush() == tok.decode(ids), text


def test_merges_rank_by_the_merged_tokens_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]  # "bc" ranks before "ab", though "ab" comes first in the file
    assert score_ranked_merges(tokens, scores) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def test_gemma3_file_serves_its_chat_and_generates(files, loaded):
    """Gemma 3's template renders through the server's path, its turns encode as one token each, <end_of_turn>
    ends a reply, and greedy tokens through the loaded file equal transformers' on the folder."""
    import transformers

    folder, path = files["gemma3"]
    model = load_model(str(path), weights="f32", use_cache=False)
    tok = model.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is free software?"}]
    text = render(tok, messages, add_generation_prompt=True, tools=None)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nWhat is free software?<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text, add_special=False)  # the template writes <bos> itself
    start, end = (tok.tokenizer.token_to_id(t) for t in TURNS)
    assert ids[:2] == [tok.bos_id, start] and ids.count(start) == 2 and ids.count(end) == 1
    assert end in tok.eos_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert greedy(model.forward, model.config, ids, 8) == hf_greedy(hf, ids, 8)


def test_other_tokenizer_models_are_refused_by_name(files, tmp_path):
    path = rewritten(files["llama"][1], tmp_path / "t5.gguf", fields={"tokenizer.ggml.model": "t5"})
    with pytest.raises(UnsupportedModel, match=r"t5\.gguf: GGUF tokenizer.ggml.model 't5' is not supported"):
        read_gguf(path)

"""SentencePiece GGUF files made the way users get them: a small SentencePiece BPE trained on a text Debian ships,
put beside a tiny random transformers checkpoint by transformers' own Gemma or Llama tokenizer, and converted by
llama.cpp's convert_hf_to_gguf.py. Also llama.cpp's own tokenizer on a file, through llama-server's /tokenize."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import httpx
import torch

from models.catalog import cache_dir
from server.local import free_port, wait_healthy

from .gguf_files import LLAMA_CPP_PYTHON

CORPUS = Path("/usr/share/common-licenses/GPL-3")
# A few lines of other scripts, so that multi-byte characters are pieces and merge; an emoji stays outside
# the vocabulary and needs its bytes.
OTHER_SCRIPTS = "Café déjà vu, naïve façade. Ελληνικά κείμενα. 東京と大阪。 Привет, мир!\n" * 20
TURNS = ["<start_of_turn>", "<end_of_turn>"]
# Each kind as its family writes it: Gemma's control pieces first and no dummy prefix (llama.cpp's converter
# writes add_space_prefix false for Gemma); Llama's (and Mistral's) <unk> <s> </s> and a prefix space, and
# Phi-3's <|end|> and <|endoftext|> (llama.cpp refuses a file named Phi-3 without the latter).
KINDS = {
    "gemma3": dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
                   unk_piece="<unk>", add_dummy_prefix=False, user_defined_symbols=TURNS),
    "llama": dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True,
                  user_defined_symbols=[*TURNS, "<|end|>", "<|endoftext|>"]),
}
# Gemma 3's chat template, its text part (images left out), as its tokenizer_config.json carries it
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}{%- set "
    "loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- if (message['role'] == 'user') "
    "!= (loop.index0 % 2 == 0) -%}{{ raise_exception(\"Conversation roles must alternate user/assistant/user/"
    "assistant/...\") }}{%- endif -%}{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + "
    "(first_user_prefix if loop.first else \"\") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)


def train_sentencepiece(folder: Path, kind: str) -> Path:
    """folder/tokenizer.model: a 1,000-piece SentencePiece BPE with byte fallback, digits split and runs of
    spaces as pieces (as Llama's and Gemma's are), its text left unnormalized (llama.cpp normalizes nothing)."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text(CORPUS.read_text() + OTHER_SCRIPTS)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=1000, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2, **KINDS[kind])
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()
    return folder / "tokenizer.model"


def write_spm_checkpoint(folder: Path, kind: str, seed: int = 0) -> Path:
    """A tiny random Gemma 3 or Llama checkpoint whose tokenizer is transformers' GemmaTokenizer or LlamaTokenizer
    read from a SentencePiece model trained here, tokenizer.model kept beside it for llama.cpp's converter."""
    import transformers

    model_file = train_sentencepiece(folder / "sentencepiece", kind)
    ids = KINDS[kind]
    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                  bos_token_id=ids["bos_id"], eos_token_id=ids["eos_id"], pad_token_id=max(ids["pad_id"], 0))
    torch.manual_seed(seed)
    if kind == "gemma3":
        # query_pre_attn_scalar = head_dim: llama.cpp's files scale attention by head_dim
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common, query_pre_attn_scalar=16))
        tokenizer = transformers.GemmaTokenizer.from_pretrained(model_file.parent, mask_token=None)
        tokenizer.chat_template = GEMMA3_TEMPLATE
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
        tokenizer = transformers.LlamaTokenizer.from_pretrained(model_file.parent)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if kind == "gemma3" else 1.0, 0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    shutil.copy(model_file, folder / "tokenizer.model")
    # transformers 5 no longer writes added_tokens_decoder, which llama.cpp's converter reads the added tokens'
    # types from (control if special, user-defined if not), and which released checkpoints carry
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}
    config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def llama_server_binary() -> Path | None:
    """The llama-server that bench/llama_server.py builds from the same sdist, if it has been built."""
    path = cache_dir() / "llama-server" / LLAMA_CPP_PYTHON / "build" / "bin" / "llama-server"
    return path if path.is_file() else None


@contextlib.contextmanager
def llama_server_client(binary: Path, gguf: Path, threads: int = 1, extra: tuple[str, ...] = ()):
    """llama-server on `gguf`, one slot of 512 tokens: an httpx client at its URL, once it is healthy."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-c", "512", "-np", "1", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, proc)
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def llama_cpp_tokenizer(binary: Path, gguf: Path):
    """llama.cpp's tokenizer on `gguf`: a function text, add_special -> ids, through llama-server's /tokenize
    (special tokens parsed, as kvserve does)."""
    with llama_server_client(binary, gguf) as client:
        def tokenize(text: str, add_special: bool = False) -> list[int]:
            body = {"content": text, "add_special": add_special, "parse_special": True}
            return client.post("/tokenize", json=body).raise_for_status().json()["tokens"]

        yield tokenize


def with_scores(source: Path, out: Path, scores: list[float]) -> Path:
    """`source` (an F32 file) written again with other token scores."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = scores if name == "tokenizer.ggml.scores" else field.contents()
        writer.add_key_value(name, value, field.types[0], field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@contextlib.contextmanager
def llama_cpp_greedy(binary: Path, gguf: Path):
    """llama.cpp's greedy continuation on `gguf`: a function ids, n -> the n token ids llama-server picks
    after them, one sequence at a time, no prompt cache."""
    with llama_server_client(binary, gguf, threads=2) as client:
        def greedy(ids: list[int], n: int) -> list[int]:
            body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False,
                    "return_tokens": True, "ignore_eos": True}
            return client.post("/completion", json=body).raise_for_status().json()["tokens"]

        yield greedy

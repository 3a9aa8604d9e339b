"""Build a GGUF file's tokenizer from its own metadata, with the `tokenizers` library alone.

A GGUF carries no tokenizer.json: it stores the vocabulary under llama.cpp's keys
(`tokenizer.ggml.model`, `.pre`, `.tokens`, `.token_type`, `.scores`, `.merges`, the special ids,
`.add_bos_token`, `.add_space_prefix`) and the chat template under `tokenizer.chat_template`.
This module rebuilds the tokenizer llama.cpp would run from those keys, without torch (which
transformers' own GGUF tokenizer path imports):

- `gpt2` (byte-level BPE: SmolLM2, Qwen2/2.5/3, Llama 3): the file's merges, a pre-tokenizer split
  chosen by `tokenizer.ggml.pre` (the regexes llama.cpp uses for that name), byte-level spelling.
- `llama` (SentencePiece-style BPE with byte fallback: Llama 2, Mistral): merges recovered from the
  tokens' scores (a SentencePiece BPE merges the pair whose result scores highest first), spaces
  spelled "▁", a "▁" put before the text when `add_space_prefix` says so, unknown bytes as the
  `<0xNN>` tokens.
- `gemma4` (Gemma 4): the same SentencePiece-style BPE without the "▁" prefix, with the file's own
  merges (its converter writes them) instead of the scores', over runs of newlines and runs of
  anything else apart (llama.cpp's `[^\n]+|[\n]+` for this vocabulary).

Control tokens (`<|im_start|>`, `<s>`) and user-defined ones are matched whole in the text; the
result is a transformers `PreTrainedTokenizerFast` (which does not need torch), so the rest of
jaxinfer keeps one tokenizer interface: encode, decode, apply_chat_template, save_pretrained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.gguf_file import read_gguf_header

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer splits, by `tokenizer.ggml.pre`: the text is cut into pieces by these regexes
# before BPE runs inside each piece (llama.cpp's choice for each name).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# name -> (regexes applied in turn, ignore_merges). ignore_merges: a piece that is itself a token
# is emitted whole (Llama 3's rule).
PRE_TOKENIZER_SPLITS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{name: ((_GPT2,), False) for name in ("default", "gpt-2", "gpt2", "phi-2", "stablelm2", "olmo", "roberta-bpe")},
    **{name: ((r"\p{N}", _GPT2), False)
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{name: ((_LLAMA3,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")},
    **{name: ((_QWEN2,), False) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
    "tekken": ((_TEKKEN,), False),
}

TOKENIZER_MODELS = ("gpt2", "llama", "gemma4")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte 0..255 as one printable character (the spelling byte-level
    BPE vocabularies are written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = 0
    table = {}
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` keys of a GGUF file (read from its header only)."""
    meta = read_gguf_header(path).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def build_gguf_tokenizer(path: str | Path):
    """The tokenizer of the GGUF file at `path`, as a transformers PreTrainedTokenizerFast.

    CheckpointError naming the file and the kind when `tokenizer.ggml.model` is missing or not one
    of TOKENIZER_MODELS, or when a byte-level file names a pre-tokenizer this module does not know.
    """
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    meta = tokenizer_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise CheckpointError(f"{path}: tokenizer.ggml.model={kind!r} is not a tokenizer jaxinfer can build "
                              f"(supported: {', '.join(TOKENIZER_MODELS)})")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise CheckpointError(f"{path}: no tokenizer.ggml.tokens in the file")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{path}: {len(types)} token types for {len(tokens)} tokens")

    if kind == "gpt2":
        backend = _byte_level_bpe(path, meta, tokens, types)
        add_bos_default = False
    else:
        backend = _sentencepiece_bpe(path, meta, tokens, types, file_merges=kind == "gemma4")
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise

    # Control and user-defined tokens are matched whole in the text, before any splitting.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def _byte_level_bpe(path: Path, meta: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise CheckpointError(f"{path}: tokenizer.ggml.pre={pre!r} names a pre-tokenizer jaxinfer does not know "
                              f"(known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))})")
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise CheckpointError(f"{path}: a byte-level BPE vocabulary (tokenizer.ggml.model='gpt2') needs "
                              f"tokenizer.ggml.merges, which the file lacks")
    splits, ignore_merges = PRE_TOKENIZER_SPLITS[pre]

    # Ordinary tokens are spelled in GPT-2's byte alphabet; one that is not (a rare mislabel) is
    # respelled so BPE can reach it. Control and user-defined tokens keep their text: they are
    # matched whole in the input, never built by merges.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty not in (CONTROL, USER_DEFINED) and not set(t) <= alphabet:
            t = "".join(spelling[b] for b in t.encode("utf-8", errors="surrogateescape"))
        vocab.setdefault(t, i)
    pairs = [_merge_pair(path, m) for m in merges]

    backend = Tokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(path: Path, meta: dict, tokens: list[str], types: list[int], *, file_merges: bool = False) -> Tokenizer:
    """A SentencePiece-style BPE: merges from the scores, or (`file_merges`, Gemma 4) the file's own."""
    if file_merges:
        merges = [_merge_pair(path, m) for m in meta.get("tokenizer.ggml.merges") or ()]
        if not merges:
            raise CheckpointError(f"{path}: a gemma4 vocabulary needs tokenizer.ggml.merges, which the file lacks")
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CheckpointError(f"{path}: a SentencePiece vocabulary (tokenizer.ggml.model='llama') needs one "
                                  f"tokenizer.ggml.scores entry per token")
        merges = _merges_from_scores(tokens, types, scores)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None

    backend = Tokenizer(models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not file_merges))
    spaces = [normalizers.Replace(" ", "▁")]
    backend.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if add_space_prefix else []) + spaces)
    if file_merges:  # Gemma 4: newline runs and the text between them merge apart
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return backend


def _merge_pair(path: Path, merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise CheckpointError(f"{path}: tokenizer.ggml.merges entry {merge!r} is not two tokens separated by a space")
    return left, right


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies.

    SentencePiece joins, at each step, the adjacent pair whose joined piece has the highest score.
    Every way of cutting a normal token into two tokens of the vocabulary is a merge; ordering the
    merges by the joined token's score (then by the left part's id, as SentencePiece breaks ties
    leftmost) gives BPE the same choices.
    """
    ids = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (NORMAL, USER_DEFINED):
            ids.setdefault(t, i)
    ranked = []
    for t, i in ids.items():
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]

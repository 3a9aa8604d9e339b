"""Tokenizer and chat template, from an HF folder, a converted folder or a GGUF file.

HF and converted folders carry a tokenizer.json, read by transformers. A GGUF file's tokenizer is
rebuilt from its metadata by `checkpoints_conv.gguf_tokenizer` (no torch needed), then saved once
under the cache folder (keyed by the file's path, size, modification time and the builder's
version) and read back from there afterwards.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from checkpoints_conv.gguf_tokenizer import build_gguf_tokenizer
from jaxinfer.runtime.loading import ModelSource

# Bump when checkpoints_conv.gguf_tokenizer builds a different tokenizer from the same file, so
# tokenizers cached by an older build are not reused.
GGUF_TOKENIZER_VERSION = "jaxinfer-gguf-tokenizer-1"


def cache_root() -> Path:
    return Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer"))


def gguf_tokenizer_cache_dir(path: Path) -> Path:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{GGUF_TOKENIZER_VERSION}"
    return cache_root() / "tokenizers" / hashlib.sha256(ident.encode()).hexdigest()[:16]


def load_tokenizer(source: ModelSource):
    if source.kind != "gguf":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source.path))

    from transformers import PreTrainedTokenizerFast

    cached = gguf_tokenizer_cache_dir(source.path)
    if (cached / "tokenizer.json").is_file():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(cached))
        except Exception:  # a damaged cache entry: rebuild it below
            pass
    tokenizer = build_gguf_tokenizer(source.path)
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError:
        pass  # a read-only home is fine, just slower next time
    return tokenizer

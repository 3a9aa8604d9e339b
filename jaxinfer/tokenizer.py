"""Tokenizer and chat template, from an HF folder, a converted folder or a GGUF file.

Everything goes through transformers' own loaders. Building a tokenizer from GGUF metadata takes
seconds, so the result is saved once under the cache folder (keyed by the file's path, size and
modification time) and read back from there afterwards.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from jaxinfer.loading import ModelSource


def cache_root() -> Path:
    return Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer"))


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    if source.kind != "gguf":
        return AutoTokenizer.from_pretrained(str(source.path))
    st = source.path.stat()
    key = hashlib.sha256(f"{source.path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_root() / "tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a damaged cache entry: rebuild it below
            pass
    tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError:
        pass  # a read-only home is fine, just slower next time
    return tokenizer

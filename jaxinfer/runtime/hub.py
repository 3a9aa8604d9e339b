"""Hugging Face Hub ids -> folders in huggingface_hub's cache.

    folder = hub_snapshot("meta-llama/Llama-3.1-8B-Instruct", revision=None)
    file = hub_snapshot("bartowski/Qwen2.5-7B-Instruct-GGUF:Qwen2.5-7B-Instruct-Q4_K_M.gguf")

A model reference that is no local path and reads `org/name` is a Hub id (`runtime.loading.
resolve_model`). `huggingface_hub` does the rest as it always does: the local cache first
(HF_HOME / HF_HUB_CACHE), a download with its progress bars when online, `revision` (a branch,
tag or commit), HF_HUB_OFFLINE=1 (the cache alone), gated and private repositories through its
token (HF_TOKEN or `hf auth login`). Its errors come back as FileNotFoundError (no such
repository, revision or file; not cached while offline) or ValueError (gated, malformed id), each
naming the id.

Only the files jaxinfer reads are fetched: configs and tokenizers (*.json, tokenizer.model,
*.txt, *.tiktoken, *.jinja) and *.safetensors, at the repository's top level. Never .bin / .pt /
.pth: no pickle is ever loaded. A GGUF repository holds many files, one per quantization: the
id names one after a colon, `org/name:file.gguf`.
"""

from __future__ import annotations

import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import errors

# A repository id: "org/name" (letters, digits, "-", "_", "."), optionally ":file.gguf".
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[^:/\\][^:\\]*\.gguf))?")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken", "*.jinja"]
IGNORE_PATTERNS = ["*/*"]  # subfolders (original/ consolidated checkpoints, onnx/, ...)


def is_hub_id(reference: str) -> bool:
    """Whether `reference` reads as a Hub id (`org/name` or `org/name:file.gguf`)."""
    return HUB_ID.fullmatch(reference) is not None


def hub_snapshot(reference: str, revision: str | None = None) -> Path:
    """The cached folder of Hub repository `org/name` at `revision` (default: main) holding its
    configs, tokenizer and safetensors, or the cached file of `org/name:file.gguf`; downloaded
    first when not cached and the Hub can be reached."""
    m = HUB_ID.fullmatch(reference)
    if m is None:
        raise ValueError(f"model {reference!r}: not a Hugging Face Hub id (org/name, or org/name:file.gguf)")
    repo, filename = m.group("repo"), m.group("file")
    at = f" at revision {revision!r}" if revision else ""
    try:
        if filename is not None:
            return Path(huggingface_hub.hf_hub_download(repo, filename, revision=revision))
        folder = Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                                        ignore_patterns=IGNORE_PATTERNS))
    except errors.GatedRepoError as e:
        raise ValueError(f"model {repo!r} is gated on the Hugging Face Hub: accept its terms on its page, then log in "
                         f"(`hf auth login`) or set HF_TOKEN") from e
    except errors.RepositoryNotFoundError as e:
        raise FileNotFoundError(f"model {repo!r}: no such local path, and no such repository on the Hugging Face Hub "
                                f"(a private one needs `hf auth login` or HF_TOKEN)") from e
    except errors.RevisionNotFoundError as e:
        raise FileNotFoundError(f"model {repo!r}: the Hugging Face Hub repository has no revision {revision!r}") from e
    except (errors.EntryNotFoundError, errors.LocalEntryNotFoundError) as e:  # a missing file, or offline and not cached
        what = f"file {filename!r}" if filename else "snapshot"
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        raise FileNotFoundError(
            f"model {repo!r}: no such local path, and no {what}{at} in the Hugging Face cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE})"
            + (" and HF_HUB_OFFLINE is set" if offline else " and none could be downloaded")
            + f" (huggingface_hub: {str(e).splitlines()[0]})"
        ) from e
    except errors.HFValidationError as e:
        raise ValueError(f"model {reference!r}: not a valid Hugging Face Hub id ({e})") from e
    except errors.HfHubHTTPError as e:  # the Hub is down, the repository disabled, ...
        raise RuntimeError(f"model {repo!r}: the Hugging Face Hub answered {str(e).splitlines()[0]}") from e
    if not (folder / "config.json").is_file():
        raise ValueError(f"model {repo!r}: the Hugging Face Hub repository{at} has no config.json; a GGUF repository "
                         f"needs the file named: {repo}:<file>.gguf")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model {repo!r}: the Hugging Face Hub repository{at} has no .safetensors weights (jaxinfer "
                         f"never loads pickled .bin / .pt files)")
    return folder

"""A model's recommended sampling settings, from its generation_config.json, as vLLM applies them.

    generation_defaults("auto", model_folder)    # {"temperature": 0.6, "top_p": 0.9, "max_tokens": 512}
    generation_defaults("vllm", model_folder)    # {}: the file is ignored, SamplingParams' own defaults hold
    generation_defaults("/a/folder", model_folder)   # that folder's generation_config.json

vLLM (`--generation-config auto|vllm|<folder>`, `LLM.get_default_sampling_params()`) reads six
fields of the file, those it sets: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens, which becomes max_tokens. A request that leaves a field unset gets the file's
value; what a request sets wins. Every other field (do_sample, the token ids) is left alone.
The values are checked as SamplingParams checks them: a bad file is refused, naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxinfer.sampling_params import SamplingParams

FILE = "generation_config.json"
# generation_config.json field -> SamplingParams field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(choice: str | os.PathLike, model_folder: str | os.PathLike | None) -> dict:
    """SamplingParams field -> default, from the generation config `choice` names: "auto" (the
    model folder's file, if it has one; a GGUF file has none), "vllm" (none), or a folder that
    must hold one. ValueError naming the file when a value is out of range or the file unreadable."""
    if str(choice) == "vllm":
        return {}
    if str(choice) == "auto":
        if model_folder is None or not (Path(model_folder) / FILE).is_file():
            return {}
        path = Path(model_folder) / FILE
    else:
        path = Path(choice) / FILE
        if not path.is_file():
            raise ValueError(f"generation_config={str(choice)!r}: no {FILE} there (give 'auto', 'vllm' or a folder holding one)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {ours: config[theirs] for theirs, ours in FIELDS.items() if config.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults

"""Pooling: a prompt's final-normed hidden states -> one vector (an embedding, or a classifier's
probabilities), for an engine built with runner="pooling".

A pooling request is one prefill and nothing after it: the scheduler runs its prompt in chunks
like any prompt, each chunk asking the step for the hidden-state rows its pooling reads
(`PoolState.rows`: every token for MEAN, the last for LAST, the first for CLS); the runner's
pooling step returns those rows instead of sampling (runtime.step: the LM head is never
computed), `PoolState.add` folds them in as each step is read, and the chunk that reaches the
prompt's end finishes the request, which frees its pages at once.

What a model pools by (`PoolerConfig.from_folder`), as sentence-transformers configures it: the
folder's `modules.json` names a Pooling module (`1_Pooling/config.json`: `pooling_mode_lasttoken`,
`pooling_mode_mean_tokens` or `pooling_mode_cls_token`) and maybe a Normalize module; without
one, LAST and normalized (what decoder embedding models use). A `*ForSequenceClassification`
checkpoint's `score` head [labels, H] makes it a classifier (LAST, not normalized): its pooled
vector becomes the labels' probabilities (one label: a sigmoid, as rerankers give it; several: a
softmax). A request's `PoolingParams` may override the type and normalization, and truncate to
`dimensions` for models trained for it (Matryoshka).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from checkpoints_conv import SafetensorsSource
from checkpoints_conv.views import CLASSIFIER_TENSORS
from jaxinfer.pooling_params import POOLING_TYPES, PoolingParams

# sentence-transformers' Pooling config keys -> our pooling types (other modes are refused)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a model pools unless a request says otherwise."""

    hidden_size: int
    pooling_type: str = "LAST"
    normalize: bool = True
    classifier: np.ndarray | None = None  # [labels, H] float32: a sequence-classification head
    classifier_bias: np.ndarray | None = None  # [labels]
    matryoshka: bool = False  # `dimensions` may truncate its embeddings

    @classmethod
    def from_folder(cls, folder: Path | None, hf_config: dict, hidden_size: int, override: dict | None = None) -> "PoolerConfig":
        """The pooler of a model folder (None: a GGUF file or the like: LAST, normalized);
        `override` ({"pooling_type", "normalize"}) takes the place of what the folder says.
        ValueError naming the file for a configuration it cannot follow."""
        pooling_type, normalize = "LAST", True
        classifier = bias = None
        if folder is not None:
            pooling_type, normalize = _sentence_transformers(folder, pooling_type, normalize)
            classifier, bias = _classifier(folder, hf_config)
            if classifier is not None:  # a reranker / classifier: its head reads the last token's state
                pooling_type, normalize = "LAST", False
        override = dict(override or {})
        unknown = set(override) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config: unknown keys {sorted(unknown)} (expected 'pooling_type', 'normalize')")
        checked = PoolingParams(pooling_type=override.get("pooling_type"), normalize=override.get("normalize"))
        matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
        return cls(hidden_size, checked.pooling_type or pooling_type,
                   normalize if checked.normalize is None else checked.normalize, classifier, bias, matryoshka)

    @property
    def num_labels(self) -> int:
        return 0 if self.classifier is None else self.classifier.shape[0]

    def check(self, params: PoolingParams, label: str) -> None:
        """Raises ValueError, starting with `label`, for params this model cannot pool by."""
        if params.task == "classify" and self.classifier is None:
            raise ValueError(f"{label}: task 'classify' needs a sequence-classification model (a checkpoint with a "
                             f"'score' head); this one only embeds")
        if params.dimensions is not None:
            if params.task != "embed":
                raise ValueError(f"{label}: PoolingParams.dimensions applies to embeddings only")
            if not self.matryoshka:
                raise ValueError(f"{label}: PoolingParams.dimensions={params.dimensions}: this model was not trained "
                                 f"to truncate its embeddings (its config has no matryoshka_dimensions)")
            if params.dimensions > self.hidden_size:
                raise ValueError(f"{label}: PoolingParams.dimensions={params.dimensions} exceeds the embedding size "
                                 f"{self.hidden_size}")

    def state(self, params: PoolingParams, num_tokens: int) -> "PoolState":
        """A request's pooling, as `params` asks and this model's defaults fill in."""
        pooling_type = params.pooling_type or self.pooling_type
        normalize = self.normalize if params.normalize is None else params.normalize
        return PoolState(pooling_type, normalize, params.dimensions, params.task, num_tokens)

    def finish(self, state: "PoolState") -> list[float]:
        """A finished PoolState's vector: the embedding, or the classifier's probabilities."""
        vector = state.pooled()  # [H] float64
        if state.task == "classify":
            logits = self.classifier.astype(np.float64) @ vector
            if self.classifier_bias is not None:
                logits = logits + self.classifier_bias
            if len(logits) == 1:
                return [float(1.0 / (1.0 + np.exp(-logits[0])))]
            e = np.exp(logits - logits.max())
            return (e / e.sum()).tolist()
        if state.dimensions is not None:
            vector = vector[: state.dimensions]
        if state.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.tolist()


@dataclasses.dataclass
class PoolState:
    """One request's pooling as its prompt's chunks come back."""

    pooling_type: str
    normalize: bool
    dimensions: int | None
    task: str
    num_tokens: int  # the prompt's
    upto: int = 0  # prompt positions folded in so far (a recomputed chunk skips them)
    total: np.ndarray | None = None  # [H] float64: the sum (MEAN) or the row (LAST, CLS)

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type={self.pooling_type!r}: expected one of {POOLING_TYPES}")

    @property
    def cached_tokens(self) -> int | None:
        """How many leading prompt tokens may take their K/V from the prefix cache: LAST reads
        the last token alone (any prefix may be cached); MEAN and CLS read rows of the prompt's
        tokens from `upto` on, which must be computed (Sequence.max_cached_tokens)."""
        return None if self.pooling_type == "LAST" else self.upto

    def rows(self, start: int, num_tokens: int) -> list[int]:
        """Offsets, in a chunk of `num_tokens` prompt tokens from position `start`, of the tokens
        whose hidden states it reads."""
        end = start + num_tokens
        if self.pooling_type == "MEAN":
            return list(range(max(self.upto, start) - start, num_tokens))
        wanted = self.num_tokens - 1 if self.pooling_type == "LAST" else 0
        return [wanted - start] if start <= wanted < end and wanted >= self.upto else []

    def add(self, start: int, num_tokens: int, hidden: np.ndarray) -> None:
        """Folds in a chunk's rows: hidden [len(rows(start, num_tokens)), H], in their order."""
        if len(hidden):
            rows = hidden.astype(np.float64).sum(axis=0) if self.pooling_type == "MEAN" else hidden[0].astype(np.float64)
            self.total = rows if self.total is None else self.total + rows
        self.upto = max(self.upto, start + num_tokens)

    @property
    def done(self) -> bool:
        return self.upto >= self.num_tokens

    def pooled(self) -> np.ndarray:
        return self.total / self.num_tokens if self.pooling_type == "MEAN" else self.total


def cosine(u: np.ndarray, v: np.ndarray) -> float:
    """The cosine similarity of two vectors (an embedding model's score of a pair)."""
    return float(u @ v / max(float(np.linalg.norm(u) * np.linalg.norm(v)), 1e-12))


def _sentence_transformers(folder: Path, pooling_type: str, normalize: bool) -> tuple[str, bool]:
    """(pooling type, normalize) from a sentence-transformers folder's modules.json, or the
    defaults given when it has none."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return pooling_type, normalize
    try:
        modules = json.loads(modules_file.read_text())
    except ValueError as e:
        raise ValueError(f"{modules_file}: not valid JSON: {e}") from None
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    other = [t for t in types if t not in (_ST_POOLING, _ST_NORMALIZE, _ST_TRANSFORMER)]
    if other:
        raise ValueError(f"{modules_file}: module {other[0]!r} is not supported (a Transformer, a Pooling and a "
                         f"Normalize module are)")
    normalize = _ST_NORMALIZE in types
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return pooling_type, normalize
    config_file = folder / pooling.get("path", "1_Pooling") / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: cannot read the Pooling module's config: {e}") from None
    if not config.get("include_prompt", True):
        raise ValueError(f"{config_file}: include_prompt=false (pooling over the text after an instruction) is not supported")
    unsupported = [key for key in _ST_UNSUPPORTED if config.get(key)]
    chosen = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(f"{config_file}: expected exactly one of {sorted(_ST_MODES)} set, got "
                         f"{sorted(k for k in (*_ST_MODES, *_ST_UNSUPPORTED) if config.get(k))}")
    return chosen[0], normalize


def _classifier(folder: Path, hf_config: dict) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A sequence-classification checkpoint's head: (weight [labels, H], bias [labels] or None)."""
    if not any(str(a).endswith("ForSequenceClassification") for a in hf_config.get("architectures") or ()):
        return None, None
    source = SafetensorsSource(folder)
    stored = dict(source.listing())
    weight_name, bias_name = CLASSIFIER_TENSORS
    if weight_name not in stored:
        raise ValueError(f"{folder}: a {hf_config['architectures'][0]} checkpoint without its {weight_name!r} tensor")
    weight = np.asarray(source.read(weight_name), np.float32)
    bias = np.asarray(source.read(bias_name), np.float32) if bias_name in stored else None
    return weight, bias

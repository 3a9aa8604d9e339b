"""Which served model answers a request that names "auto": a small policy over plain numbers.

    policy = RoutingPolicy(["small", "large"], long_prompt_tokens=512, confidence_threshold=-2.5)
    policy.decide(prompt_tokens=40, confidence=-1.2, load=lambda route: 0)   # Decision("small", "confident")

The server (jaxinfer.server.multi_model) measures, the policy decides. For a request naming
"auto", in this order:

1. length: a prompt of more than `long_prompt_tokens` tokens (the small model's tokens) goes to
   the `large` route ("long_prompt");
2. confidence: with a `confidence_threshold`, the small model's own confidence on the prompt, its
   mean prompt-token logprob, decides: below the threshold -> `large` ("low_confidence"), else
   `small` ("confident"); an unknown confidence (the estimate failed) -> `large` ("no_confidence");
3. otherwise `small` ("default").

Then the load rule (adaptive precision): with `high` / `low` / `queue`, a request bound for the
`high` route (for "auto", and with `adaptive_precision` also a request naming `high`) goes to the
`low` route when `high`'s engine holds more than `queue` requests, waiting or running
("under_load"). A request naming a model is otherwise "named".

Feedback: `feedback(response_id, score)` for a response whose decision was remembered
(`remember`, the last `max_remembered`): a bad answer (score 0, or good=false) from the small
model when the threshold sent it there raises the threshold by `feedback_step` (more prompts go
to the large model), a good one (score 1) lowers it; a score s in [0, 1] moves it by
feedback_step * (1 - 2 s), always within [threshold_min, threshold_max]. Every verdict is counted
per route; a response takes one verdict.

Counters (`choices`, `verdicts`) feed the server's /metrics and GET /v1/routing (`snapshot`).
Nothing here touches a model: every rule is unit-tested with numbers (tests/test_routing.py).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable

REASONS = ("named", "long_prompt", "low_confidence", "no_confidence", "confident", "default", "under_load")


@dataclasses.dataclass(frozen=True)
class Decision:
    route: str
    reason: str  # one of REASONS: a metrics label and the x-jaxinfer-route-reason header
    detail: str = ""  # the numbers behind it, for people ("mean prompt logprob -3.10 < -2.50")

    @property
    def header(self) -> str:
        return f"{self.reason}; {self.detail}" if self.detail else self.reason


def parse_options(text: str, flag: str) -> dict[str, str]:
    """"a=1,b=x" -> {"a": "1", "b": "x"} (keys with '-' read as '_'); ValueError naming `flag`."""
    options = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"{flag}: expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
        if key in options:
            raise ValueError(f"{flag}: {key} given twice in {text!r}")
        options[key] = value
    return options


class RoutingPolicy:
    def __init__(self, routes, *, small: str | None = None, large: str | None = None,
                 long_prompt_tokens: int | None = None, confidence_threshold: float | None = None,
                 threshold_min: float = -10.0, threshold_max: float = 0.0, feedback_step: float = 0.1,
                 high: str | None = None, low: str | None = None, queue: int | None = None,
                 adaptive_precision: bool = False, max_remembered: int = 10000):
        """`routes`: the served models' names, the first the default. `small` / `large` default
        to the first and the last route. ValueError naming the setting at fault."""
        self.routes = list(routes)
        if not self.routes:
            raise ValueError("routes: no model to route to")
        self.small = self.routes[0] if small is None else small
        self.large = self.routes[-1] if large is None else large
        for key, name in (("small", self.small), ("large", self.large), ("high", high), ("low", low)):
            if name is not None and name not in self.routes:
                raise ValueError(f"{key}={name!r}: no model of that name is served (served: {self.routes})")
        if long_prompt_tokens is not None and long_prompt_tokens < 0:
            raise ValueError(f"long_prompt_tokens={long_prompt_tokens}: must be >= 0")
        if not threshold_min <= threshold_max:
            raise ValueError(f"threshold_min={threshold_min} > threshold_max={threshold_max}")
        if confidence_threshold is not None and not threshold_min <= confidence_threshold <= threshold_max:
            raise ValueError(f"confidence_threshold={confidence_threshold}: outside [threshold_min={threshold_min}, "
                             f"threshold_max={threshold_max}] (mean prompt logprobs are <= 0)")
        if feedback_step < 0:
            raise ValueError(f"feedback_step={feedback_step}: must be >= 0")
        if (high is None) != (low is None) or (high is None) != (queue is None):
            raise ValueError("the load rule needs all of high, low and queue")
        if high is not None and high == low:
            raise ValueError(f"high={high!r} and low={low!r}: two different models")
        if queue is not None and queue < 0:
            raise ValueError(f"queue={queue}: must be >= 0")
        if adaptive_precision and high is None:
            raise ValueError("adaptive_precision needs the load rule (high, low, queue)")
        if max_remembered < 1:
            raise ValueError(f"max_remembered={max_remembered}: must be >= 1")
        self.long_prompt_tokens, self.confidence_threshold = long_prompt_tokens, confidence_threshold
        self.threshold_min, self.threshold_max, self.feedback_step = threshold_min, threshold_max, feedback_step
        self.high, self.low, self.queue, self.adaptive_precision = high, low, queue, adaptive_precision
        self.max_remembered = max_remembered
        self.choices: collections.Counter = collections.Counter()  # (route, reason) -> requests
        self.verdicts: collections.Counter = collections.Counter()  # (route, "good" | "bad") -> feedback
        self._recent: collections.OrderedDict[str, Decision] = collections.OrderedDict()  # response id -> decision
        self._lock = threading.Lock()

    @classmethod
    def from_options(cls, routes, policy: str | None = None, under_load: str | None = None,
                     adaptive_precision: bool = False) -> "RoutingPolicy":
        """From the command line's strings: `policy` "small=A,large=B,long_prompt_tokens=N,
        confidence_threshold=X,threshold_min=X,threshold_max=X,feedback_step=X" (--routing-policy),
        `under_load` "high=A,low=B,queue=N" (--route-under-load). ValueError naming the flag."""
        kwargs = {}
        types = {"small": str, "large": str, "long_prompt_tokens": int, "confidence_threshold": float,
                 "threshold_min": float, "threshold_max": float, "feedback_step": float}
        for flag, text, known in (("--routing-policy", policy, types),
                                  ("--route-under-load", under_load, {"high": str, "low": str, "queue": int})):
            if text is None:
                continue
            for key, value in parse_options(text, flag).items():
                if key not in known:
                    raise ValueError(f"{flag}: unknown option {key!r}; it takes {sorted(known)}")
                try:
                    kwargs[key] = known[key](value)
                except ValueError:
                    raise ValueError(f"{flag}: {key}={value!r} is not {'an integer' if known[key] is int else 'a number'}") from None
            if flag == "--route-under-load" and not {"high", "low", "queue"} <= kwargs.keys():
                raise ValueError(f"{flag}: give high=NAME,low=NAME,queue=N, got {text!r}")
        try:
            return cls(routes, adaptive_precision=adaptive_precision, **kwargs)
        except ValueError as e:  # each message starts with the setting's name
            first = str(e).split("=")[0].split(" ")[0]
            flag = ("--route-under-load" if first in ("high", "low", "queue", "the") else
                    "--adaptive-precision" if first == "adaptive_precision" else "--routing-policy")
            raise ValueError(f"{flag}: {e}") from None

    # ------------------------------------------------------------------ deciding
    @property
    def needs_prompt(self) -> bool:
        """Whether "auto" needs the prompt's length (the length or the confidence rule is on)."""
        return self.long_prompt_tokens is not None or self.confidence_threshold is not None

    def needs_confidence(self, prompt_tokens: int | None) -> bool:
        """Whether "auto" for a prompt of this many tokens asks for the small model's confidence
        (a prefill of the prompt on the small model): the confidence rule is on and the length
        rule has not already decided."""
        return self.confidence_threshold is not None and not self._long(prompt_tokens)

    def _long(self, prompt_tokens: int | None) -> bool:
        return self.long_prompt_tokens is not None and prompt_tokens is not None and prompt_tokens > self.long_prompt_tokens

    def decide(self, prompt_tokens: int | None = None, confidence: float | None = None,
               load: Callable[[str], int] = lambda route: 0) -> Decision:
        """The route of an "auto" request (counted): `prompt_tokens` its (longest) prompt's length,
        `confidence` the small model's mean prompt-token logprob (None: unknown), `load(route)`
        the requests a route's engine holds."""
        threshold = self.confidence_threshold
        if self._long(prompt_tokens):
            decision = Decision(self.large, "long_prompt", f"{prompt_tokens} prompt tokens > {self.long_prompt_tokens}")
        elif threshold is not None and confidence is None:
            decision = Decision(self.large, "no_confidence", "the small model's confidence could not be measured")
        elif threshold is not None and confidence < threshold:
            decision = Decision(self.large, "low_confidence", f"mean prompt logprob {confidence:.3f} < {threshold:.3f}")
        elif threshold is not None:
            decision = Decision(self.small, "confident", f"mean prompt logprob {confidence:.3f} >= {threshold:.3f}")
        else:
            decision = Decision(self.small, "default")
        return self._count(self._under_load(decision, load))

    def named(self, model: str, load: Callable[[str], int] = lambda route: 0) -> Decision:
        """The route of a request naming `model` (counted): itself, or with adaptive_precision the
        low-precision route when `model` is the loaded high-precision one."""
        decision = Decision(model, "named")
        return self._count(self._under_load(decision, load) if self.adaptive_precision else decision)

    def _under_load(self, decision: Decision, load: Callable[[str], int]) -> Decision:
        if self.high is None or decision.route != self.high:
            return decision
        held = load(self.high)
        if held > self.queue:
            return Decision(self.low, "under_load", f"{self.high} holds {held} requests > {self.queue}")
        return decision

    def _count(self, decision: Decision) -> Decision:
        with self._lock:
            self.choices[(decision.route, decision.reason)] += 1
        return decision

    # ------------------------------------------------------------------ feedback
    def remember(self, response_id: str, decision: Decision) -> None:
        """Keeps `decision` for feedback on `response_id` (the last max_remembered responses)."""
        with self._lock:
            self._recent[response_id] = decision
            self._recent.move_to_end(response_id)
            while len(self._recent) > self.max_remembered:
                self._recent.popitem(last=False)

    def feedback(self, response_id: str, score: float) -> Decision:
        """A verdict on a remembered response: score 1 good ... 0 bad. Moves the threshold when
        the confidence rule sent the request to the small model. KeyError for an unknown (or
        already judged, or forgotten) id; ValueError for a score outside [0, 1]."""
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"score={score}: expected a number in [0, 1]")
        with self._lock:
            decision = self._recent.pop(response_id)  # one verdict per response
            self.verdicts[(decision.route, "good" if score >= 0.5 else "bad")] += 1
            if decision.reason == "confident" and self.confidence_threshold is not None:
                moved = self.confidence_threshold + self.feedback_step * (1.0 - 2.0 * score)
                self.confidence_threshold = min(self.threshold_max, max(self.threshold_min, moved))
        return decision

    def counts(self) -> tuple[dict, dict]:
        """Copies of (choices, verdicts), taken together."""
        with self._lock:
            return dict(self.choices), dict(self.verdicts)

    def snapshot(self) -> dict:
        """The policy's settings and counts (GET /v1/routing)."""
        with self._lock:
            choices: dict[str, dict[str, int]] = {r: {} for r in self.routes}
            for (route, reason), n in sorted(self.choices.items()):
                choices[route][reason] = n
            feedback: dict[str, dict[str, int]] = {r: {"good": 0, "bad": 0} for r in self.routes}
            for (route, verdict), n in self.verdicts.items():
                feedback[route][verdict] = n
            return {
                "routes": list(self.routes), "default": self.routes[0], "small": self.small, "large": self.large,
                "long_prompt_tokens": self.long_prompt_tokens, "confidence_threshold": self.confidence_threshold,
                "threshold_bounds": [self.threshold_min, self.threshold_max], "feedback_step": self.feedback_step,
                "under_load": None if self.high is None else {"high": self.high, "low": self.low, "queue": self.queue},
                "adaptive_precision": self.adaptive_precision,
                "choices": choices, "feedback": feedback,
            }

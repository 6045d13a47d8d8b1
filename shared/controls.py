"""Generation controls beyond max_tokens/temperature/top_p/top_k/seed: their domain shape, their
limits and the one check of them (docs/generation.md); and the one check that max_tokens is a
positive integer (check_max_tokens, reason MAX_TOKENS_INVALID). The gateway holds clients to it; the
inference engine runs the same check on what it is handed, so an in-process caller cannot slip a
NaN penalty into a batch either.

Reasons: STOP_INVALID, REPETITION_PENALTY_OUT_OF_RANGE, FREQUENCY_PENALTY_OUT_OF_RANGE,
PRESENCE_PENALTY_OUT_OF_RANGE, TOP_LOGPROBS_OUT_OF_RANGE, TOP_LOGPROBS_WITHOUT_LOGPROBS,
PROMPT_LOGPROBS_OUT_OF_RANGE,
CHOICE_INVALID, RESPONSE_FORMAT_TOO_LARGE (each with metadata `field`). Whether a JSON Schema or
a regex compiles is the inference stage's to say (services/inference/engine/grammar.py).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from keel.common.v1 import common_pb2
from shared.errors import InvalidInput

MAX_TEMPERATURE = 2.0
# The mesh's one seed range: the API field is uint64, but inference seeds an int64 generator.
SEED_MAX = 2**63 - 1
MAX_STOPS = 4
MAX_STOP_BYTES = 64
MAX_REPETITION_PENALTY = 2.0
MAX_ABS_PENALTY = 2.0          # frequency and presence penalties: -2..2
MAX_TOP_LOGPROBS = 5
MAX_CHOICES = 64
MAX_FORMAT_BYTES = 16384       # a JSON Schema, regex or Lark document, or all choices together (UTF-8)
FORMAT_KINDS = ("json_schema", "regex", "choice", "lark")


@dataclass(frozen=True)
class ResponseFormat:
    """What the answer must conform to: a JSON Schema document, a regex, one of some strings, or a
    grammar in llguidance's Lark dialect."""

    kind: str                        # one of FORMAT_KINDS
    document: str = ""               # json_schema, regex or lark
    choices: tuple[str, ...] = ()    # choice

    @property
    def digest(self) -> str:
        """sha256 of the kind and the document: the compiled grammar's cache key."""
        body = json.dumps([self.kind, self.document, list(self.choices)], ensure_ascii=False)
        return hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Controls:
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0  # 1 = off (the proto's 0 means unset and becomes 1)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: ResponseFormat | None = None
    min_tokens: int = 0       # the model's end ids and the stop ids are masked until this many tokens
    ignore_eos: bool = False  # the model's end ids do not end the answer
    # Score the prompt's tokens with this many alternatives each (None: not scored); the engine
    # computes them in the prefill, which then reuses no prefix-cache blocks.
    prompt_logprobs: int | None = None
    echo: bool = False  # the answer's text begins with the prompt's (the gateway's to serve)

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def repetition_penalty_of(value: float) -> float:
    """The proto's unset 0 is off, which is 1 in Hugging Face's terms."""
    return 1.0 if value == 0.0 else value


def check_max_tokens(value, name: str = "max_tokens", **metadata) -> None:
    """Raise InvalidInput MAX_TOKENS_INVALID (metadata `actual` and the caller's keys) unless ``value``
    is an integer >= 1; ``name`` is the field as the caller's client spelled it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput(f"{name} must be an integer >= 1, got {value!r}", reason="MAX_TOKENS_INVALID",
                           metadata={"actual": value, **metadata})


def check_sampling(temperature, top_p, top_k, seed, **metadata) -> None:
    """Raise InvalidInput with the rule's reason (metadata `field` and the caller's keys) unless each
    sampling value is in range: temperature 0..2, top_p in (0, 1], top_k >= 0, seed 0..SEED_MAX or None.
    The one check of these rules: the gateway holds clients to it, the engine its direct callers."""
    def bad(message: str, reason: str, field: str, **more) -> InvalidInput:
        return InvalidInput(message, reason=reason, metadata={"field": field, **more, **metadata})

    if not _number(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise bad(f"temperature must be in 0..{MAX_TEMPERATURE:g}, got {temperature!r}", "TEMPERATURE_OUT_OF_RANGE",
                  "sampling.temperature")
    if not _number(top_p) or not 0.0 < top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {top_p!r}", "TOP_P_OUT_OF_RANGE", "sampling.top_p")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise bad(f"top_k must be an integer >= 0, got {top_k!r}", "TOP_K_OUT_OF_RANGE", "sampling.top_k")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX):
        raise bad(f"seed must be in 0..{SEED_MAX}", "SEED_OUT_OF_RANGE", "sampling.seed", limit=SEED_MAX,
                  actual=seed if isinstance(seed, int) else str(seed))


def check_controls(c: Controls, max_tokens: int) -> None:
    """Raise InvalidInput with the rule's reason (metadata `field`) unless every control is in range
    (`max_tokens`: the request's, which min_tokens may not pass)."""
    def bad(message: str, reason: str, field: str) -> InvalidInput:
        return InvalidInput(message, reason=reason, metadata={"field": field})

    if isinstance(c.min_tokens, bool) or not isinstance(c.min_tokens, int) or not 0 <= c.min_tokens <= max_tokens:
        raise bad(f"min_tokens must be in 0..max_tokens ({max_tokens}), got {c.min_tokens!r}",
                  "MIN_TOKENS_OUT_OF_RANGE", "sampling.min_tokens")
    if len(c.stop) > MAX_STOPS:
        raise bad(f"at most {MAX_STOPS} stop strings, got {len(c.stop)}", "STOP_INVALID", "sampling.stop")
    for s in c.stop:
        if not isinstance(s, str) or not 1 <= len(s.encode("utf-8", "surrogatepass")) <= MAX_STOP_BYTES:
            raise bad(f"each stop string must be 1..{MAX_STOP_BYTES} UTF-8 bytes", "STOP_INVALID", "sampling.stop")
    if not _number(c.repetition_penalty) or not 0.0 < c.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise bad(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (0 or 1 = off)",
                  "REPETITION_PENALTY_OUT_OF_RANGE", "sampling.repetition_penalty")
    if not _penalty(c.frequency_penalty):
        raise bad(f"frequency_penalty must be in -{MAX_ABS_PENALTY}..{MAX_ABS_PENALTY}",
                  "FREQUENCY_PENALTY_OUT_OF_RANGE", "sampling.frequency_penalty")
    if not _penalty(c.presence_penalty):
        raise bad(f"presence_penalty must be in -{MAX_ABS_PENALTY}..{MAX_ABS_PENALTY}",
                  "PRESENCE_PENALTY_OUT_OF_RANGE", "sampling.presence_penalty")
    if isinstance(c.top_logprobs, bool) or not isinstance(c.top_logprobs, int) \
            or not 0 <= c.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", "TOP_LOGPROBS_OUT_OF_RANGE",
                  "sampling.top_logprobs")
    if c.top_logprobs and not c.logprobs:
        raise bad("top_logprobs needs logprobs set", "TOP_LOGPROBS_WITHOUT_LOGPROBS", "sampling.top_logprobs")
    if c.prompt_logprobs is not None and (isinstance(c.prompt_logprobs, bool) or not isinstance(c.prompt_logprobs, int)
                                          or not 0 <= c.prompt_logprobs <= MAX_TOP_LOGPROBS):
        raise bad(f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}", "PROMPT_LOGPROBS_OUT_OF_RANGE",
                  "sampling.prompt_logprobs")
    if c.response_format is not None:
        _check_format(c.response_format, bad)


def _check_format(f: ResponseFormat, bad) -> None:
    field = f"response_format.{f.kind}"
    if f.kind == "choice":
        if not 1 <= len(f.choices) <= MAX_CHOICES or not all(isinstance(v, str) and v for v in f.choices):
            raise bad(f"choice needs 1..{MAX_CHOICES} non-empty strings", "CHOICE_INVALID", field)
        size = sum(len(v.encode("utf-8", "surrogatepass")) for v in f.choices)
    else:
        size = len(f.document.encode("utf-8", "surrogatepass"))
    if size > MAX_FORMAT_BYTES:
        raise format_too_large(field, size)


def format_too_large(field: str, size: int) -> InvalidInput:
    """RESPONSE_FORMAT_TOO_LARGE for a document of ``size`` UTF-8 bytes at ``field`` (the OpenAI HTTP
    stage raises it too, for a schema nested too deep to parse, as the gateway would answer it)."""
    return InvalidInput(f"{field} is {size} bytes, the limit is {MAX_FORMAT_BYTES}", reason="RESPONSE_FORMAT_TOO_LARGE",
                        metadata={"field": field})


def _penalty(x) -> bool:
    return _number(x) and -MAX_ABS_PENALTY <= x <= MAX_ABS_PENALTY


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def controls_of(s: common_pb2.SamplingParams, fmt: common_pb2.ResponseFormat | None) -> Controls:
    """The controls of a request's sampling parameters and response format (None: unset)."""
    return Controls(stop=tuple(s.stop), repetition_penalty=repetition_penalty_of(s.repetition_penalty),
                    frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                    logprobs=s.logprobs, top_logprobs=s.top_logprobs, response_format=format_of(fmt),
                    min_tokens=s.min_tokens, ignore_eos=s.ignore_eos, echo=s.echo,
                    prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None)


def format_of(fmt: common_pb2.ResponseFormat | None) -> ResponseFormat | None:
    which = fmt.WhichOneof("format") if fmt is not None else None
    if which is None:
        return None
    if which == "choice":
        return ResponseFormat("choice", choices=tuple(fmt.choice.values))
    return ResponseFormat(which, document=getattr(fmt, which))


@dataclass(frozen=True)
class Sampling:
    """A request's sampling parameters: the decoding ones and the controls (common.v1.SamplingParams)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None          # None: the engine draws one (and reports it)
    controls: Controls = Controls()  # the response format travels beside SamplingParams (format_pb)


def sampling_pb(s: Sampling) -> common_pb2.SamplingParams:
    """The one builder of common.v1.SamplingParams (gateway, CLI, replay, quarantine, OpenAI API)."""
    c = s.controls
    pb = common_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, stop=c.stop,
        repetition_penalty=0.0 if c.repetition_penalty == 1.0 else c.repetition_penalty,
        frequency_penalty=c.frequency_penalty, presence_penalty=c.presence_penalty, logprobs=c.logprobs,
        top_logprobs=c.top_logprobs, min_tokens=c.min_tokens, ignore_eos=c.ignore_eos, echo=c.echo)
    if s.seed is not None:
        pb.seed = s.seed
    if c.prompt_logprobs is not None:
        pb.prompt_logprobs = c.prompt_logprobs
    return pb


def format_pb(fmt: ResponseFormat | None) -> common_pb2.ResponseFormat | None:
    if fmt is None:
        return None
    if fmt.kind == "choice":
        return common_pb2.ResponseFormat(choice=common_pb2.Choices(values=fmt.choices))
    return common_pb2.ResponseFormat(**{fmt.kind: fmt.document})

"""Keel's one exception hierarchy. Core code raises these; it never imports grpc.

    KeelError                      (base; never raised itself)
    ├── InvalidInput               INVALID_ARGUMENT     bad request: fix it, do not retry
    ├── PreconditionFailed         FAILED_PRECONDITION  can never succeed as sent (e.g. exceeds memory budget)
    ├── Unauthenticated            UNAUTHENTICATED      missing or wrong credential
    ├── PermissionDenied           PERMISSION_DENIED    credential valid, action not allowed
    ├── NotFound                   NOT_FOUND            named thing does not exist
    ├── Recoverable                (the caller may retry, honouring retry_after_ms)
    │   ├── Overloaded             RESOURCE_EXHAUSTED   queue full, rate limited
    │   ├── NotReady               UNAVAILABLE          warming up, draining, breaker open, upstream down
    │   └── DeadlineExpired        DEADLINE_EXCEEDED    ran out of time
    ├── Cancelled                  CANCELLED            the client went away
    ├── NumericalInstability       OUT_OF_RANGE         NaN/inf in one row's logits; that row fails alone,
    │                                                       retrying the same input fails again
    └── Fatal                      INTERNAL             a bug or a dead component (logged with its stack)

Each error carries a machine-readable ``reason`` (UPPER_SNAKE, goes into google.rpc.ErrorInfo),
free-form ``metadata`` (str -> str, also ErrorInfo) and, for recoverable errors, a retry hint.
The translation to gRPC status lives in exactly one place per side:
``shared/interceptor.py`` (server) and ``shared/client.py`` (client).
"""
from __future__ import annotations

DOMAIN = "keel.dev"

# Reasons the mesh itself sets when a process stops (not the stages' own refusals):
SHUTTING_DOWN = "SHUTTING_DOWN"      # a draining stage cut a call it could not finish, or refused a new one
CONNECTION_LOST = "CONNECTION_LOST"  # no server answered: the upstream process died or its port is closed


class KeelError(Exception):
    """Base of every error Keel raises on purpose."""

    code = "INTERNAL"  # name of the grpc.StatusCode member; kept as a string so core code stays grpc-free
    default_reason = "INTERNAL"

    def __init__(self, message: str, *, reason: str | None = None,
                 metadata: dict[str, str] | None = None, retry_after_ms: int | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.retry_after_ms = retry_after_ms

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class InvalidInput(KeelError):
    code = "INVALID_ARGUMENT"
    default_reason = "INVALID_INPUT"


class PreconditionFailed(KeelError):
    code = "FAILED_PRECONDITION"
    default_reason = "FAILED_PRECONDITION"


class Unauthenticated(KeelError):
    code = "UNAUTHENTICATED"
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(KeelError):
    code = "PERMISSION_DENIED"
    default_reason = "PERMISSION_DENIED"


class NotFound(KeelError):
    code = "NOT_FOUND"
    default_reason = "NOT_FOUND"


class Recoverable(KeelError):
    """The same request may succeed later; ``retry_after_ms`` is the server's hint."""


class Overloaded(Recoverable):
    code = "RESOURCE_EXHAUSTED"
    default_reason = "OVERLOADED"


class NotReady(Recoverable):
    code = "UNAVAILABLE"
    default_reason = "NOT_READY"


class DeadlineExpired(Recoverable):
    code = "DEADLINE_EXCEEDED"
    default_reason = "DEADLINE_EXCEEDED"


class Cancelled(KeelError):
    code = "CANCELLED"
    default_reason = "CANCELLED"


class Fatal(KeelError):
    code = "INTERNAL"
    default_reason = "INTERNAL"


class NumericalInstability(KeelError):
    """NaN/inf in a row's logits. The row fails alone; retrying the same input will fail again."""

    code = "OUT_OF_RANGE"
    default_reason = "NUMERICAL_INSTABILITY"


# Reasons (ErrorInfo.reason) of refused inputs and callers, named once for every stage.
INPUT_CHECK_BUDGET_EXCEEDED = "INPUT_CHECK_BUDGET_EXCEEDED"  # the input check ran out of CPU time
INVISIBLE_INPUT = "INVISIBLE_INPUT"            # the text has no visible character
SEED_OUT_OF_RANGE = "SEED_OUT_OF_RANGE"        # seed outside the mesh's range (shared/controls.py SEED_MAX)
AMBIGUOUS_API_KEY = "AMBIGUOUS_API_KEY"        # several API keys presented in one request
AUTH_FAILURES_LIMITED = "AUTH_FAILURES_LIMITED"  # too many failed authentications from a peer
INVALID_ADAPTER = "INVALID_ADAPTER"            # the adapter field is not "id" or "id@version" (contract.py)
DEADLINE_UNREACHABLE = "DEADLINE_UNREACHABLE"  # inference's estimate: the request cannot finish by its deadline
# ErrorInfo metadata keys that describe the gateway's own retry handling. They stay in logs and
# traces; the gateway removes them from what its clients receive (shared/interceptor.py).
INTERNAL_METADATA_KEYS = frozenset({"retry_stop", "attempts", "retry_hint", "message_size"})


class Reason:
    """One catalogued reason: the exception class that carries it (its gRPC status) and what it
    means. ``metadata`` lists ErrorInfo keys set where the code builds the metadata away from the
    raise (shared/errordoc.py finds the others); ``cls`` None: a quarantine/flag reason only."""

    def __init__(self, cls: type[KeelError] | None, meaning: str, metadata: tuple[str, ...] = ()):
        self.cls, self.meaning, self.metadata = cls, meaning, metadata


_VERDICT_KEYS = ("rule", "contract", "domain", "field", "quarantine_id")

# Every reason Keel raises; docs/errors.md is generated from this (python -m shared.errordoc).
REASONS: dict[str, Reason] = {
    # Base classes' defaults (raised when no specific reason is given).
    "INVALID_INPUT": Reason(InvalidInput, "bad request (no more specific reason)"),
    "FAILED_PRECONDITION": Reason(PreconditionFailed, "can never succeed as sent"),
    "UNAUTHENTICATED": Reason(Unauthenticated, "missing or wrong credential"),
    "PERMISSION_DENIED": Reason(PermissionDenied, "credential valid, action not allowed"),
    "NOT_FOUND": Reason(NotFound, "the named thing does not exist"),
    "OVERLOADED": Reason(Overloaded, "too much work right now"),
    "NOT_READY": Reason(NotReady, "a stage cannot serve right now"),
    "DEADLINE_EXCEEDED": Reason(
        DeadlineExpired, "the call's deadline ran out; the message names the step that was running"),
    "CANCELLED": Reason(Cancelled, "the client cancelled the call"),
    "INTERNAL": Reason(Fatal, "a bug: logged with its stack under the trace id"),
    "NUMERICAL_INSTABILITY": Reason(NumericalInstability, "NaN/inf in the model's output"),
    # Gateway: credentials and limits.
    "MISSING_API_KEY": Reason(Unauthenticated, "no API key in `x-api-key` or `authorization: Bearer`"),
    "INVALID_API_KEY": Reason(Unauthenticated, "the API key is not recognised"),
    "RATE_LIMITED": Reason(Overloaded, "the key's rate limit is reached; retry after the hint"),
    "AMBIGUOUS_API_KEY": Reason(
        Unauthenticated, "more than one API key in a request (repeated header, or x-api-key and Bearer differ)"),
    "AUTH_FAILURES_LIMITED": Reason(
        Overloaded, "too many failed authentications from this address; retry after the hint"),
    "SEED_OUT_OF_RANGE": Reason(InvalidInput, "seed outside 0..2^63-1, the range every stage accepts"),
    "EMPTY_PROMPT": Reason(InvalidInput, "neither prompt nor chat, or only blank text"),
    "TOO_MANY_MESSAGES": Reason(InvalidInput, "more chat turns than the gateway's max_messages"),
    "UNKNOWN_ROLE": Reason(InvalidInput, "a chat role other than system, user, assistant (and tool, in Generate)"),
    "PROMPT_TOO_LARGE": Reason(
        InvalidInput, "the prompt is larger than max_prompt_bytes", _VERDICT_KEYS[:1] + ("quarantine_id",)),
    "MAX_TOKENS_INVALID": Reason(InvalidInput, "max_tokens is not a positive integer", ("field", "request_id")),
    "MAX_TOKENS_TOO_LARGE": Reason(InvalidInput, "max_tokens above the gateway's max_tokens_limit"),
    "MIN_TOKENS_OUT_OF_RANGE": Reason(InvalidInput, "min_tokens outside 0..max_tokens"),
    "N_OUT_OF_RANGE": Reason(InvalidInput, "OpenAI's n (choices per prompt) outside 1..edge.max_choices"),
    "N_WITH_GREEDY": Reason(InvalidInput, "OpenAI's n above 1 with temperature 0: every choice would be the same"),
    "TOO_MANY_PROMPTS": Reason(InvalidInput, "/v1/completions: more prompts in one request than edge.max_prompts"),
    "MAX_TOKENS_OUT_OF_RANGE": Reason(InvalidInput, "max_tokens leaves no room for the prompt in the context"),
    "TRUNCATE_PROMPT_TOKENS_OUT_OF_RANGE": Reason(
        InvalidInput, "truncate_prompt_tokens outside 0..the context less one; `field` names it", ("field",)),
    "TEMPERATURE_OUT_OF_RANGE": Reason(InvalidInput, "temperature outside 0..2"),
    "TOP_P_OUT_OF_RANGE": Reason(InvalidInput, "top_p outside (0, 1]"),
    "TOP_K_OUT_OF_RANGE": Reason(InvalidInput, "top_k negative"),
    "TOO_MANY_TOKEN_IDS": Reason(
        InvalidInput, "Detokenize: more token ids than the context; `field` names them", ("field",)),
    "INVALID_ADAPTER": Reason(
        InvalidInput, "the adapter field is not `id` or `id@version` (each 1-64 of [A-Za-z0-9._-], starting with a "
                      "letter or digit); `field` names it", ("field",)),
    # Generation controls (shared/controls.py; the grammar's reasons: services/inference/engine/grammar.py).
    "STOP_INVALID": Reason(
        InvalidInput, "more than 4 stop strings, or one empty or over 64 UTF-8 bytes; `field` names it", ("field",)),
    "REPETITION_PENALTY_OUT_OF_RANGE": Reason(
        InvalidInput, "repetition_penalty outside (0, 2] (0 or 1 = off); `field` names it", ("field",)),
    "FREQUENCY_PENALTY_OUT_OF_RANGE": Reason(
        InvalidInput, "frequency_penalty outside -2..2; `field` names it", ("field",)),
    "PRESENCE_PENALTY_OUT_OF_RANGE": Reason(
        InvalidInput, "presence_penalty outside -2..2; `field` names it", ("field",)),
    "PROMPT_LOGPROBS_OUT_OF_RANGE": Reason(InvalidInput, "prompt_logprobs outside 0..5; `field` names it", ("field",)),
    "ECHO_UNSUPPORTED": Reason(InvalidInput, "echo with a chat input or a stream; `field` names it", ("field",)),
    "INPUT_AMBIGUOUS": Reason(InvalidInput, "token_ids beside another input (prompt, text or chat)"),
    "TOP_LOGPROBS_OUT_OF_RANGE": Reason(InvalidInput, "top_logprobs outside 0..5; `field` names it", ("field",)),
    "TOP_LOGPROBS_WITHOUT_LOGPROBS": Reason(
        InvalidInput, "top_logprobs set without logprobs; `field` names it", ("field",)),
    "CHOICE_INVALID": Reason(
        InvalidInput, "response_format.choice has no value, more than 64, or an empty one; `field` names "
                      "it", ("field",)),
    "RESPONSE_FORMAT_TOO_LARGE": Reason(
        InvalidInput, "the response format's document (or all choices) is over 16384 UTF-8 bytes; `field` names "
                      "it", ("field",)),
    "RESPONSE_FORMAT_INVALID": Reason(
        InvalidInput, "the JSON Schema or regex does not compile (not JSON, unknown keyword value, bad syntax); "
                      "`field` names it, the message says why", ("field",)),
    "RESPONSE_FORMAT_TOO_COMPLEX": Reason(
        InvalidInput, "the response format did not compile within the time limit, or ran out of the grammar engine's "
                      "per-token budget while decoding; `field` names it", ("field",)),
    # Tool calls (services/gateway/tools.py).
    "TOOL_INVALID": Reason(
        InvalidInput, "a tool's name is not 1..64 of [A-Za-z0-9_-] or repeats, or its parameters are not a JSON "
                      "Schema of an object or do not compile under the grammar engine; `field` names it", ("field",)),
    "TOOL_CHOICE_INVALID": Reason(
        InvalidInput, "tool_choice names no tool of the request, or its mode is not auto, none or required; "
                      "`field` names it", ("field",)),
    "TOO_MANY_TOOLS": Reason(InvalidInput, "more tools than the gateway's max_tools; `field` names them", ("field",)),
    "TOOLS_CONFLICT": Reason(
        InvalidInput, "tools sent with response_format, or with a raw text or token-id input; `field` names it",
        ("field",)),
    "TOOLS_TOO_LARGE": Reason(
        InvalidInput, "the tools' schemas together make a grammar over 16384 UTF-8 bytes; `field` names them",
        ("field",)),
    "VOCABULARY_NOT_LOADED": Reason(
        PreconditionFailed, "an in-process engine without a vocabulary was asked for stop strings or a response "
                            "format"),
    "MALFORMED_REQUEST": Reason(InvalidInput, "the request body does not parse as the RPC's message"),
    "OUTPUT_BLOCKED": Reason(PreconditionFailed, "a blocking output check failed; `plugin` names it"),
    "STREAM_TRUNCATED": Reason(NotReady, "the inference stream ended without a result; retry"),
    "NO_HEALTHY_UPSTREAM": Reason(NotReady, "no replica of a stage is serving; retry after the hint"),
    "CONNECTION_LOST": Reason(
        NotReady, "the connection to a stage replica was lost (its process died); re-dispatched once, then retry after "
                  "the hint"),
    "MESSAGE_TOO_LARGE": Reason(Overloaded, "a message exceeds the gRPC size limit; not retried"),
    # Mesh credentials (stages behind the gateway).
    "MISSING_MESH_CREDENTIAL": Reason(Unauthenticated, "a stage was called without the mesh token"),
    "INVALID_MESH_CREDENTIAL": Reason(Unauthenticated, "a stage was called with a wrong mesh token"),
    "NOT_SERVING": Reason(NotReady, "the stage is warming up or draining; retry after the hint"),
    # Validator.
    "CONTRACT_VIOLATION": Reason(InvalidInput, "the request breaks its source's input contract", _VERDICT_KEYS),
    "UNKNOWN_DOMAIN": Reason(InvalidInput, "the domain tag is not configured", _VERDICT_KEYS),
    "LOW_QUALITY_INPUT": Reason(
        InvalidInput, "a domain's quality rule rejected the input (or only flagged it)", _VERDICT_KEYS),
    "PROMPT_INJECTION": Reason(
        InvalidInput, "a domain's pattern rule rejected the input (or only flagged it)", _VERDICT_KEYS),
    "INVISIBLE_INPUT": Reason(
        InvalidInput, "the prompt has no visible character (only zero-width, format or control "
                      "characters)", _VERDICT_KEYS),
    "INPUT_CHECK_BUDGET_EXCEEDED": Reason(
        InvalidInput, "the input checks used up the per-request CPU budget; the input is quarantined", _VERDICT_KEYS),
    "LOW_CONFIDENCE_OUTPUT": Reason(None, "quarantine record of an answer whose probes were all low (not an error)"),
    "ALREADY_DONE": Reason(PreconditionFailed, "quarantine: the record was already handled"),
    "CLAIMED_BY_OTHER": Reason(PreconditionFailed, "quarantine: another operator claimed the record"),
    "NOT_CLAIMED": Reason(PreconditionFailed, "quarantine: the record must be claimed first"),
    "SPILL_IN_USE": Reason(PreconditionFailed, "start-up: another validator owns the spill file"),
    # Feedback stage (and the gateway's SubmitFeedback in front of it).
    "TRACE_NOT_FOUND": Reason(NotFound, "no replay record for this trace id (unknown, expired, or not yet stored)"),
    "INVALID_FEEDBACK_FIELD": Reason(
        InvalidInput, "a feedback field is empty or not one of its allowed values; `field` names it", ("field",)),
    "INVALID_REPLAY_RECORD": Reason(InvalidInput, "a replay record without a valid trace id", ("field",)),
    "DATABASE_UNAVAILABLE": Reason(NotReady, "the feedback database is unreachable; retry after the hint"),
    "FEEDBACK_DISABLED": Reason(PreconditionFailed, "this gateway has no feedback stage configured"),
    "INVALID_ALERT_PAYLOAD": Reason(
        InvalidInput, "rotation webhook: the body is not an Alertmanager v4 payload; `field` names the "
                      "part", ("field",)),
    "VARIANT_SWITCH_FAILED": Reason(
        NotReady, "rotation: an inference replica did not take SetVariant; the others were switched back"),
    "MISSING_ACTOR": Reason(InvalidInput, "rotation: an approval must name who approves"),
    "DECISION_NOT_FOUND": Reason(NotFound, "rotation: no decision has this id"),
    "DECISION_NOT_PROPOSED": Reason(
        PreconditionFailed, "rotation: only a decision in state proposed can be approved; `outcome` says its "
                            "state", ("outcome",)),
    # Tokenizer.
    "EMPTY_INPUT": Reason(InvalidInput, "nothing to encode"),
    "EMPTY_MESSAGES": Reason(InvalidInput, "chat input without messages"),
    "INVALID_MESSAGES": Reason(InvalidInput, "a chat message is not a role/content pair"),
    "INVALID_INPUT_TYPE": Reason(InvalidInput, "the input is neither text nor chat"),
    "INVALID_JSON": Reason(InvalidInput, "`keel tokenize`: a line is not JSON"),
    "INVALID_OPTIONS": Reason(InvalidInput, "encode options out of range"),
    "INVALID_REQUEST": Reason(InvalidInput, "a tokenizer request field has the wrong type"),
    "INVALID_TOKEN_ID": Reason(InvalidInput, "a token id to decode is not an integer"),
    "TOKEN_ID_OUT_OF_RANGE": Reason(InvalidInput, "a token id to decode is outside the vocabulary"),
    "INVALID_UTF8": Reason(InvalidInput, "text is not valid UTF-8"),
    "INPUT_TOO_LARGE": Reason(InvalidInput, "text larger than the tokenizer accepts"),
    "MAX_LENGTH_OUT_OF_RANGE": Reason(InvalidInput, "max_length outside the stage's limit"),
    "MAX_LENGTH_REQUIRED": Reason(InvalidInput, "padding asked without a max_length"),
    "CHAT_TEMPLATE_ERROR": Reason(InvalidInput, "the chat template could not render the messages"),
    "NOT_WARMED_UP": Reason(NotReady, "the tokenizer's vocabulary is not loaded yet"),
    "SELF_CHECK_FAILED": Reason(Fatal, "start-up: the tokenizer disagrees with its reference encodings"),
    "GGUF_NOT_FOUND": Reason(PreconditionFailed, "start-up: the model's GGUF file is missing"),
    "UNSUPPORTED_TOKENIZER": Reason(PreconditionFailed, "start-up: the tokenizer is not one Keel implements"),
    "UNSUPPORTED_REGEX_VERSION": Reason(PreconditionFailed, "start-up: the pre-tokenizer regex is unknown"),
    "UNSUPPORTED_HOST": Reason(Fatal, "start-up: the host's byte order is not supported"),
    "COMPILED_FILE_BAD_MAGIC": Reason(Fatal, "start-up: the compiled vocabulary is not a vocabulary file"),
    "COMPILED_FILE_CORRUPT": Reason(Fatal, "start-up: the compiled vocabulary is inconsistent"),
    "COMPILED_FILE_STALE": Reason(Fatal, "start-up: the compiled vocabulary does not match the GGUF"),
    "COMPILED_FILE_TRUNCATED": Reason(Fatal, "start-up: the compiled vocabulary is cut short"),
    "COMPILED_FILE_UNREADABLE": Reason(Fatal, "start-up: the compiled vocabulary cannot be read"),
    "COMPILED_FILE_VERSION": Reason(Fatal, "start-up: the compiled vocabulary has another format version"),
    # Inference.
    "MISSING_REQUEST_ID": Reason(InvalidInput, "inference request without an id"),
    "DUPLICATE_REQUEST_ID": Reason(InvalidInput, "an inference request id is already in flight"),
    "CONTEXT_LENGTH_EXCEEDED": Reason(
        InvalidInput, "the prompt's tokens plus max_tokens exceed the model's context (the gateway, once the prompt is "
                      "encoded; inference for an in-process caller); the prompt is never cut unless "
                      "truncate_prompt_tokens asks (HTTP: 400, code context_length_exceeded)"),
    "TOKEN_OUT_OF_RANGE": Reason(InvalidInput, "a prompt id is outside the vocabulary"),
    "INVALID_DEADLINE": Reason(InvalidInput, "inference deadline not positive"),
    "FAULT_INJECTION_DISABLED": Reason(
        PermissionDenied, "the inference request's deprecated `faults` field is set: no stage serves fault "
                          "injection", ("field",)),
    "REQUEST_EXCEEDS_MEMORY_BUDGET": Reason(
        PreconditionFailed, "the request could never fit the stage's memory budget"),
    "QUEUE_FULL": Reason(Overloaded, "the inference queue is full; retry after the hint"),
    "QUEUE_TIMEOUT": Reason(Overloaded, "the request waited too long in the queue; retry after the hint"),
    "DEADLINE_UNREACHABLE": Reason(
        Overloaded, "the request cannot finish within its deadline at the measured decode rate (docs/inference.md); "
                    "retry after the hint, or lower max_tokens"),
    "OUT_OF_MEMORY": Reason(Overloaded, "the batch ran out of memory; retry after the hint"),
    "CIRCUIT_OPEN": Reason(NotReady, "inference's breaker is open after repeated faults; retry after the hint"),
    "WARMING_UP": Reason(NotReady, "the inference engine is loading; retry after the hint"),
    "DRAINING": Reason(NotReady, "the inference engine is draining; retry after the hint"),
    "SHUTTING_DOWN": Reason(
        NotReady, "a draining stage refused a new call or cut one it could not finish; retry after the hint"),
    "DEADLINE_EXPIRED": Reason(DeadlineExpired, "the request's deadline ran out during generation"),
    "DEADLINE_EXPIRED_IN_QUEUE": Reason(DeadlineExpired, "the request's deadline ran out while queued"),
    "NON_FINITE_LOGITS": Reason(NumericalInstability, "NaN/inf logits for this request; the same input fails again"),
    "UNKNOWN_FAILURE_KIND": Reason(
        InvalidInput, "ReportFailure named a breaker kind callers may not report (only output_limit)"),
    "VARIANT_NOT_GATED": Reason(
        PreconditionFailed, "SetVariant named a variant `auto` preloaded while its format's quality gate still runs "
                            "(or failed, or lost to a faster format)"),
    "UNKNOWN_VARIANT": Reason(
        InvalidInput, "SetVariant named a model variant this replica did not preload (GetVariant lists them)"),
    "STEP_FAILED": Reason(Fatal, "a model step failed (a bug or a dead device)"),
    "SAMPLING_FAILED": Reason(Fatal, "sampling one row failed (a bug); only that row fails, its batch-mates go on"),
    "FORMAT_MISMATCH": Reason(InvalidInput, "start-up: model weights and configured format disagree"),
    "UNKNOWN_FORMAT": Reason(InvalidInput, "start-up: the configured format is unknown"),
    "UNSUPPORTED_FORMAT": Reason(InvalidInput, "start-up: the format is not supported on this device"),
    "KERNEL_UNAVAILABLE": Reason(InvalidInput, "start-up: the gguf format's C++ kernel cannot be built or loaded"),
    "UNSUPPORTED_BLOCK_TYPE": Reason(
        InvalidInput, "start-up: the GGUF holds a block type the gguf format does not compute on"),
    "MODEL_NOT_FOUND": Reason(InvalidInput, "start-up: the model's prepared folder is missing"),
    "UNSUPPORTED_MODEL": Reason(
        InvalidInput, "start-up: the model is not one Keel implements (architecture, config or weights)"),
    "BUDGET_TOO_SMALL": Reason(InvalidInput, "start-up: the memory budget does not fit the model"),
    "INVALID_CONFIG": Reason(InvalidInput, "start-up: an inference config value is out of range"),
    # Inference: LoRA adapters (services/inference/lora; refusals at start are states, never request errors).
    "ADAPTER_NOT_FOUND": Reason(NotFound, "the request names an adapter this replica's registry does not have"),
    "ADAPTER_REFUSED": Reason(
        PreconditionFailed, "the request names an adapter refused at start; `refusal_reason` says "
                            "why", ("adapter", "refusal_reason")),
    "BASE_FINGERPRINT_MISMATCH": Reason(
        PreconditionFailed, "adapter refused: made against another base (`fields` names the differing fingerprint "
                            "fields)"),
    "UNSUPPORTED_ADAPTER_CONFIG": Reason(
        PreconditionFailed, "adapter refused: adapter_config.json has a key or feature this build does not understand "
                            "(`key`)"),
    "INERT_ADAPTER": Reason(
        PreconditionFailed, "adapter refused: its weights and targets do not match the base's modules one to one"),
    "ADAPTER_CHANGES_NOTHING": Reason(
        PreconditionFailed, "adapter refused: its greedy outputs on the check prompts equal the base model's"),
    "GOLDEN_MISMATCH": Reason(
        PreconditionFailed,
        "adapter refused: greedy outputs on the check prompts differ from the golden ones made at registration"),
    "ADAPTER_DRIFT": Reason(
        PreconditionFailed,
        "adapter refused: KL(registered || now) on the check prompts is above lora.drift_threshold"),
    "ADAPTER_RECORD_INVALID": Reason(
        PreconditionFailed, "adapter refused: its keel-adapter.json or files are missing, unreadable or changed since "
                            "registration"),
    "ADAPTER_EXISTS": Reason(PreconditionFailed, "`keel lora register`: this id@version is registered already"),
    "INVALID_ADAPTER_NAME": Reason(
        InvalidInput, "an adapter that is not a string, or (`keel lora`) an id or version with characters outside "
                      "[A-Za-z0-9_.-]"),
    # The OpenAI-compatible HTTP API (services/openai; docs/openai.md): refusals before any gateway call.
    "INVALID_BODY": Reason(
        InvalidInput, "OpenAI API: the body is not a JSON object, is nested deeper than edge.max_json_depth, or a "
                      "field is unknown (not OpenAI's: a typo), missing, NaN or of the wrong JSON type; `field` names "
                      "it", ("field",)),
    "INVALID_HEADER": Reason(
        InvalidInput, "OpenAI API: x-keel-deadline-ms is not one integer of 1..edge.max_deadline_ms, or "
                      "content-length is not an integer; `field` names the header", ("field",)),
    "INVALID_HTTP_REQUEST": Reason(
        InvalidInput, "OpenAI API: the bytes sent are not an HTTP/1.1 request (llhttp's message says where)"),
    "HEADER_TOO_LARGE": Reason(
        InvalidInput, "OpenAI API (HTTP 431): the headers are over edge.max_header_bytes or edge.max_headers, or a "
                      "header passed on to the gateway is over edge.max_forwarded_header_bytes; `field` names it "
                      "where one header is", ("field",)),
    "UNSUPPORTED_PARAMETER": Reason(
        InvalidInput, "OpenAI API: an OpenAI field Keel does not serve (tools, logit_bias, suffix, ...: "
                      "docs/openai.md), or a value of one it does not serve (n other than 1, several prompts, echo, "
                      "store: true, a service_tier other than auto/default, max_tokens and max_completion_tokens "
                      "that differ); `field` names it", ("field",)),
    "METHOD_NOT_ALLOWED": Reason(
        InvalidInput, "OpenAI API (HTTP 405): the route is served, but not with this method; `Allow` names the one "
                      "it is"),
    # Shared helpers (start-up and tools).
    "INVALID_PORT": Reason(InvalidInput, "start-up: a metrics port is out of range"),
    "UNKNOWN_STAGE": Reason(InvalidInput, "start-up: metrics asked for an unknown stage"),
    "INVALID_BUCKETS": Reason(InvalidInput, "start-up: histogram buckets are not increasing"),
    "INVALID_WINDOW": Reason(InvalidInput, "a metrics window is not positive"),
    "NON_FINITE_OBSERVATION": Reason(InvalidInput, "a metric observation is NaN/inf"),
}

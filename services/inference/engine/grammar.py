"""Constrained decoding with llguidance: the vocabulary's token bytes, and grammars compiled off the
step loop.

llguidance (Microsoft's guidance engine; a Rust wheel with no Python dependencies) turns a JSON
Schema, a regex or a Lark grammar into an Earley parser over a lazy lexer, and computes the mask
of the tokens allowed next for one row in microseconds (docs/generation.md has the measurement
against outlines-core, and why xgrammar was not taken). Its parser limits bound the work of every
mask ("fuel"), so a hostile document makes that row fail with a reason, never a step that stalls.

`Grammars.matcher(response_format)` compiles on a worker thread (the constructor releases the GIL), waits at
most `compile_timeout_s`, and caches the compiled matcher by the document's sha256 (LRU); each
request gets a deep copy. The end-of-text token is in a mask only where the grammar is complete.
"""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

# The numpy helpers, not llguidance.torch: that module wraps a function in torch.compile at import
# (start-up time spent on a path Keel does not use).
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from shared.controls import ResponseFormat
from shared.errors import InvalidInput

ENGINE_NAME = "llguidance"


@dataclass(frozen=True)
class GrammarLimits:
    compile_timeout_s: float = 2.0       # compiling one document (RESPONSE_FORMAT_TOO_COMPLEX past it)
    cache_entries: int = 256             # compiled documents kept, least recently used dropped
    step_lexer_fuel: int = 100_000       # llguidance's per-mask lexer budget (~14k/ms)
    step_max_items: int = 20_000         # llguidance's per-mask Earley item budget (~20k/ms)
    workers: int = 1                     # compile threads


class Vocabulary:
    """The model's tokens as bytes (special tokens as b"": the gateway's text skips them) and the
    llguidance tokenizer over them, from the tokenizer.json the model directory ships."""

    def __init__(self, tokenizer_json: Path, eos_token_ids: tuple[int, ...]):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json.read_text(encoding="utf-8"),
                                                eos_token=list(eos_token_ids) or None)
        n = self.tokenizer.vocab_size
        self.size = n
        raw = [self.tokenizer.decode_bytes([i]) for i in range(n)]
        self.token_bytes: tuple[bytes, ...] = tuple(
            b"" if self.tokenizer.is_special_token(i) else b for i, b in enumerate(raw))
        # A token's text as logprobs show it: special tokens literally, broken UTF-8 as U+FFFD.
        self._texts = tuple(b.decode("utf-8", "replace") for b in raw)

    def text(self, token_id: int) -> str:
        return self._texts[token_id] if 0 <= token_id < self.size else ""


def version() -> str:
    """The grammar engine's name and version, part of the serving engine's facts (Finished.engine)."""
    return f"{ENGINE_NAME}=={llguidance.__version__}"


def recursive_ref(schema) -> str | None:
    """A local `$ref` of `schema` that is reached again from inside its own target (a recursive
    schema, which no finite answer need end: the grammar engine accepts it and then fails while
    decoding), or None. Edges: ref -> the refs inside its target; a cycle from the root is one."""
    def refs(node) -> list[str]:
        if isinstance(node, dict):
            own = [node["$ref"]] if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") else []
            return own + [r for v in node.values() for r in refs(v)]
        return [r for v in node for r in refs(v)] if isinstance(node, list) else []

    def target(ref: str):
        node = schema
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node[int(part)] if isinstance(node, list) else node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None
        return node

    done: set[str] = set()

    def cycle(ref: str, path: tuple[str, ...]) -> str | None:
        if ref in path:
            return ref
        if ref in done:
            return None
        node = target(ref)
        found = next((c for c in (cycle(r, (*path, ref)) for r in refs(node)) if c), None) if node is not None else None
        done.add(ref)
        return found

    return next((c for c in (cycle(r, ()) for r in refs(schema)) if c), None)


def _grammar(response_format: ResponseFormat) -> str:
    if response_format.kind == "json_schema":
        recursive = recursive_ref(json.loads(response_format.document))
        if recursive is not None:
            raise ValueError(f"the schema is recursive ($ref {recursive[:100]!r} refers back to itself): "
                             "a recursive schema is not served")
        # Compact JSON (no free whitespace between tokens): what a client parses is the same, and
        # a model cannot spend its max_tokens on indentation.
        return llguidance.LLMatcher.grammar_from_json_schema(response_format.document,
                                                             overrides={"whitespace_flexible": False})
    if response_format.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(response_format.document)
    if response_format.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(response_format.document)
    # Lark string literals take JSON's escapes, so json.dumps quotes any choice exactly.
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(v, ensure_ascii=False) for v in response_format.choices))


@dataclass(frozen=True)
class _Refused:
    """A document that could not be turned into a grammar, cached like a matcher in error."""

    error: str

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return self.error


class Grammars:
    """Compiled grammars for one vocabulary; `matcher` is called on the asyncio side, never the loop."""

    def __init__(self, vocab: Vocabulary, limits: GrammarLimits = GrammarLimits()):
        self.vocab = vocab
        self.limits = limits
        self._parser_limits = llguidance.LLParserLimits(step_lexer_fuel=limits.step_lexer_fuel,
                                                        step_max_items=limits.step_max_items)
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="keel-grammar")
        self._cache: OrderedDict[str, llguidance.LLMatcher | _Refused] = OrderedDict()
        self._compiling: dict[str, asyncio.Future] = {}

    def _compile(self, response_format: ResponseFormat) -> llguidance.LLMatcher | _Refused:
        try:
            grammar = _grammar(response_format)
        except ValueError as exc:  # the JSON Schema document is not JSON, or is recursive
            return _Refused(str(exc))
        except RecursionError:
            return _Refused("the JSON Schema document is nested too deeply to read")
        return llguidance.LLMatcher(self.vocab.tokenizer, grammar, log_level=0, limits=self._parser_limits)

    async def matcher(self, response_format: ResponseFormat) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `response_format`'s grammar; InvalidInput when it does not compile."""
        key = response_format.digest
        field = f"response_format.{response_format.kind}"
        template = self._cache.get(key)
        if template is None:
            pending = self._compiling.get(key)
            if pending is None:
                pending = asyncio.wrap_future(self._pool.submit(self._compile, response_format))
                self._compiling[key] = pending
                pending.add_done_callback(lambda done: self._compiled(key, done))
            try:
                template = await asyncio.wait_for(asyncio.shield(pending), self.limits.compile_timeout_s)
            except TimeoutError:
                raise InvalidInput(f"{field} did not compile within {self.limits.compile_timeout_s} s",
                                   reason="RESPONSE_FORMAT_TOO_COMPLEX", metadata={"field": field}) from None
        if key in self._cache:
            self._cache.move_to_end(key)
        if template.is_error():
            raise InvalidInput(f"{field} does not compile: {template.get_error()[:300]}",
                               reason="RESPONSE_FORMAT_INVALID", metadata={"field": field})
        return template.deep_copy()

    def _compiled(self, key: str, done: asyncio.Future) -> None:
        """Cache a finished compile, even one every waiter gave up on (a document that fails is kept
        too: refused again at no cost)."""
        self._compiling.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return
        self._cache[key] = done.result()
        while len(self._cache) > self.limits.cache_entries:
            self._cache.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class MaskExecutor:
    """llguidance's thread pool that computes a step's masks for all constrained rows at once (the
    Rust side drops the GIL and runs the rows in parallel, one thread per core torch uses)."""

    def __init__(self, threads: int):
        self.executor = llguidance.LLExecutor(num_threads=max(1, threads))


def allowed(masks: MaskExecutor, matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """The matchers' next-token masks as bool [len(matchers), vocab_size] (ids beyond the matchers'
    vocabulary are never allowed). A matcher that fails leaves its row empty and its error set."""
    bits = allocate_token_bitmask(len(matchers), vocab_size)  # [G, ceil(V/32)] int32, bit j of word w: id 32w + j
    fill_next_token_bitmask_par(masks.executor, [(m, g) for g, m in enumerate(matchers)], bits)
    unpacked = (torch.from_numpy(bits).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [G, W, 32]
    return unpacked.view(len(matchers), -1)[:, :vocab_size].bool()

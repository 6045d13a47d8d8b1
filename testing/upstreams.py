"""A scripted in-process stand-in for the gateway's Upstreams (no grpc): what the pipeline tests
and the feedback bench drive the gateway pipeline with."""
from __future__ import annotations

import asyncio
from array import array

from keel.common.v1 import common_pb2
from services.gateway.values import Done, Encoded, Step
from services.tokenizer.decoding import Decoder, StreamDecoder
from shared import errors

EMOJI = "\U0001F600"
# A byte-level vocabulary for the fake tokenizer: id i is chr(96 + i), except 10 and 11, the two
# halves of EMOJI's UTF-8 bytes; 12, a real U+FFFD; 13, a special token.
_TOKENS = [chr(96 + i).encode() for i in range(10)] + [EMOJI.encode()[:2], EMOJI.encode()[2:],
                                                         "\ufffd".encode(), b"<|end|>"]
VOCAB = Decoder(memoryview(array("I", [sum(map(len, _TOKENS[:i])) for i in range(len(_TOKENS) + 1)])),
                memoryview(b"".join(_TOKENS)), frozenset({13}))


class FakeDecodeStream:
    """The tokenizer's DecodeStream with the real stream decoder on VOCAB."""

    def __init__(self, up: "FakeUpstreams"):
        self.up, self.decoder = up, StreamDecoder(VOCAB, skip_special_tokens=True)

    async def send(self, ids, finish):
        self.up.decoded.append(tuple(ids))
        text = self.decoder.extend(ids) + (self.decoder.finish() if finish else "")
        self.up.decode_called.set()
        if self.up.lose_response == len(self.up.decoded):  # the tokenizer took the ids, then died
            raise errors.NotReady("tokenizer replica died", reason="NOT_SERVING")
        return text

    def close(self):
        self.up.closed += 1


class FakeUpstreams:
    def __init__(self, tokens=(5, 6, 7), texts=None, verdict_pass=True, fail_generate=0, paced=False,
                 lose_response=0):
        self.calls: list[str] = []
        self.lose_response, self.closed, self.validated = lose_response, 0, []
        self.decoded: list[tuple[int, ...]] = []
        # paced: each token after the first waits until the gateway decoded the previous ones
        self.paced, self.decode_called = paced, asyncio.Event()
        self.tokens, self.verdict_pass, self.fail_generate = tokens, verdict_pass, fail_generate
        self.texts = texts or {}
        self.seeds: list[int] = []
        self.quarantined: list[tuple[str, dict]] = []
        self.reports: list[tuple[str, str, str]] = []
        self.encoded: list[Encoded] = []  # what each generation was handed
        self.payloads: list[dict] = []    # what the input contract saw

    async def validate_input(self, payload, source, domain, timeout, md, rejected=None):
        self.calls.append("validate_input")
        if rejected is not None:  # as the real validator: quarantine, then answer the same rejection
            self.quarantined.append((rejected.reason, payload))
            raise errors.InvalidInput(rejected.message, reason=rejected.reason,
                                      metadata={"rule": "gateway_limits", "quarantine_id": "q-1"})
        self.payloads.append(payload)
        return ["low_quality"] if "meh" in str(payload) else []

    async def encode_chat(self, messages, max_length, timeout, md, **_):
        self.calls.append("encode")
        return Encoded([1, 2, 3], False, 3, "fp")

    async def encode_text(self, text, max_length, timeout, md):
        """One id per character (VOCAB's letters), the last ``max_length`` kept."""
        self.calls.append("encode_text")
        ids = [ord(c) - 96 for c in text]
        return Encoded(ids[-max_length:], len(ids) > max_length, len(ids), "fp-text")

    async def generate(self, enc, ask, seed, timeout, md):
        self.calls.append("generate")
        self.seeds.append(seed)
        self.encoded.append(enc)
        if self.fail_generate:
            self.fail_generate -= 1
            raise errors.NotReady("replica died", reason="NOT_SERVING")
        for i, t in enumerate(self.tokens):
            if self.paced and i:
                await self.decode_called.wait()
                self.decode_called.clear()
            yield Step(t, 0.5)
        scored = () if ask.controls.prompt_logprobs is None else tuple(
            common_pb2.TokenLogprob(token=chr(96 + t), token_id=t, logprob=-float(i)) for i, t in enumerate(enc.ids))
        yield Done("stop", len(enc.ids), len(self.tokens), seed, {"format": "float32"}, "inference-a",
                   prompt_logprobs=scored)

    async def decode(self, ids, timeout, md, skip_special_tokens=True):
        self.calls.append("decode")
        if any(not 0 <= i < len(_TOKENS) for i in ids):  # as the tokenizer: ids outside the vocabulary
            raise errors.InvalidInput("a token id is outside the vocabulary", reason="TOKEN_ID_OUT_OF_RANGE")
        self.decoded.append(tuple(ids))
        self.decode_called.set()
        return self.texts.get(tuple(ids), "".join(chr(96 + i) for i in ids))

    async def decode_stream(self, timeout, md):
        self.calls.append("decode_stream")
        return FakeDecodeStream(self)

    async def report_failure(self, replica, kind, cause, md):
        self.reports.append((replica, kind, cause))

    async def validate_output(self, text, ask, entropies, timeout, md):
        self.calls.append("validate_output")
        self.validated.append(text)
        verdicts = [common_pb2.Verdict(plugin="forbidden", passed=self.verdict_pass, message="" if self.verdict_pass
                                       else "no", blocking=True)]
        return text.upper(), common_pb2.ValidationResult(passed=self.verdict_pass, verdicts=verdicts,
                                                         probes={"entropy_mean": 0.5})


async def no_sleep(_s):
    return None

"""Gateway servicer: protobuf <-> domain conversion only; the pipeline does the work."""
from __future__ import annotations

import grpc

from keel.common.v1 import common_pb2
from keel.feedback.v1 import feedback_pb2
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.contract import Ask, Limits
from services.gateway.deadlines import deadline_from
from services.gateway.pipeline import Pipeline
from services.gateway.tokens import Tokens
from services.gateway.tools import Tool, Toolbox, ToolCall, TurnTools
from services.gateway.values import Answer, Call, Delta
from shared import tracing
from shared.controls import controls_of


def to_toolbox(req: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest) -> Toolbox | None:
    if not req.tools and not req.HasField("tool_choice"):
        return None
    return Toolbox(tools=tuple(Tool(t.name, t.description, t.parameters, t.strict) for t in req.tools),
                   mode=req.tool_choice.mode, function=req.tool_choice.function,
                   parallel=req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True)


def to_turn_tools(messages) -> tuple[TurnTools, ...]:
    """Each turn's calls and call id, when any turn has some (else ())."""
    if not any(m.tool_calls or m.tool_call_id for m in messages):
        return ()
    return tuple(TurnTools(tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls), m.tool_call_id)
                 for m in messages)


def to_ask(req: gateway_pb2.GenerateRequest, limits: Limits) -> Ask:
    which = req.WhichOneof("input")
    messages, raw, text = (), None, None  # none: check_ask refuses it (EMPTY_PROMPT), the quarantine keeps it
    turn_tools: tuple[TurnTools, ...] = ()
    if which == "prompt":
        messages, raw = (("user", req.prompt),), req.prompt
    elif which == "chat":
        messages = tuple((m.role, m.content) for m in req.chat.messages)
        turn_tools = to_turn_tools(req.chat.messages)
    elif which == "text":
        text = req.text
    s = req.sampling
    return Ask(messages=messages, max_tokens=s.max_tokens or limits.default_max_tokens,
               temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
               seed=s.seed if s.HasField("seed") else None, domain=req.domain, source=req.source, raw_prompt=raw,
               text=text, token_ids=tuple(req.token_ids),
               adapter=req.adapter, max_tokens_set=s.max_tokens != 0, truncate_prompt_tokens=s.truncate_prompt_tokens,
               controls=controls_of(s, req.response_format if req.HasField("response_format") else None),
               tools=to_toolbox(req), turn_tools=turn_tools)


def to_response(a: Answer) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        text=a.text, trace_id=a.trace_id, finish_reason=a.finish_reason, seed=a.seed,
        usage=common_pb2.Usage(prompt_tokens=a.prompt_tokens, completion_tokens=a.completion_tokens),
        validation=a.validation, prompt_truncated=a.prompt_truncated, input_flags=a.input_flags,
        system_fingerprint=a.system_fingerprint, adapter=a.adapter, logprobs=a.logprobs,
        prompt_logprobs=a.prompt_logprobs,
        tool_calls=[c.pb() for c in a.tool_calls])


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, pipeline: Pipeline, limits: Limits, feedback):
        self.pipeline, self.limits = pipeline, limits
        self.tokens = Tokens(pipeline, limits)
        self.feedback = feedback  # services/gateway/recording.py: forwards to the feedback stage

    def _call(self, context: grpc.aio.ServicerContext) -> Call:
        """The call's context, once: deadline (less the answer margin), trace id, inbound metadata."""
        deadline, default = deadline_from(context.time_remaining(), self.limits)
        return Call(deadline, tracing.current_trace_id(),
                    {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}, default)

    async def Generate(self, request, context):
        answer = await self.pipeline.generate(to_ask(request, self.limits), self._call(context))
        return to_response(answer)

    async def GenerateStream(self, request, context):
        async for item in self.pipeline.stream(to_ask(request, self.limits), self._call(context)):
            if isinstance(item, Delta):
                yield gateway_pb2.GenerateStreamResponse(delta=item.text, logprobs=item.logprobs)
            else:
                yield gateway_pb2.GenerateStreamResponse(done=to_response(item))

    async def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(adapters=await self.pipeline.adapters(self._call(context)))

    async def Tokenize(self, request, context):
        text = request.text if request.WhichOneof("input") == "text" else None  # neither: EMPTY_PROMPT
        chat = Ask(messages=tuple((m.role, m.content) for m in request.chat.messages), max_tokens=0,
                   tools=to_toolbox(request), turn_tools=to_turn_tools(request.chat.messages))
        ids = await self.tokens.tokenize(text, chat, request.add_generation_prompt, self._call(context))
        return gateway_pb2.TokenizeResponse(token_ids=ids, context_tokens=self.limits.max_context_tokens)

    async def Detokenize(self, request, context):
        text = await self.tokens.detokenize(list(request.token_ids), self._call(context))
        return gateway_pb2.DetokenizeResponse(text=text)

    async def SubmitFeedback(self, request, context):
        remaining = context.time_remaining()
        item = feedback_pb2.SubmitRequest(
            trace_id=request.trace_id, feedback_id=request.feedback_id, error_type=request.error_type,
            severity=request.severity, expected_keywords=request.expected_keywords, comment=request.comment)
        stored = await self.feedback.submit(item, remaining if remaining is not None
                                            else self.limits.default_deadline_ms / 1000)
        return gateway_pb2.SubmitFeedbackResponse(feedback_id=stored.feedback_id, created=stored.created)

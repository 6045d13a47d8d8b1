"""A deadline that runs out during a downstream call reaches the client in plain words."""
from __future__ import annotations

import pytest

from services.gateway.values import Call
from shared import errors
from testing.upstreams import FakeUpstreams
from tests.gateway.test_pipeline import ask, pipeline


class SlowTokenizer(FakeUpstreams):
    async def encode_chat(self, messages, max_length, timeout, md, **_):
        # What shared/client.py makes of grpc's own DEADLINE_EXCEEDED from an upstream.
        raise errors.DeadlineExpired("Deadline Exceeded", metadata={"retry_hint": "absent"})


@pytest.mark.asyncio
async def test_an_upstream_deadline_names_the_step_and_drops_retry_fields():
    with pytest.raises(errors.DeadlineExpired) as exc:
        await pipeline(SlowTokenizer()).generate(ask(), Call(1e12, "t" * 32))
    err = exc.value
    assert err.code == "DEADLINE_EXCEEDED" and err.reason == "DEADLINE_EXCEEDED"
    assert "deadline ran out while the gateway waited for tokenizer (Encode)" in err.message
    assert err.metadata == {"upstream": "tokenizer", "step": "Encode"}

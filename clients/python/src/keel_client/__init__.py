"""keel-client: call Keel's gateway from Python.

    from keel_client import Client
    with Client("localhost:50051", api_key="...") as keel:
        answer = keel.generate("What is the capital of France?", max_tokens=32)
        print(answer.text, answer.trace_id)
        for event in keel.stream("Tell me a story.", max_tokens=64):
            print(event.text if isinstance(event, Delta) else f"\\n[{event.finish_reason}]")
"""
from keel_client import errors
from keel_client.client import AsyncClient, AsyncStream, Client, Reconnect, Stream
from keel_client.types import Alternative, Answer, Delta, TokenLogprob, Verdict

__all__ = ["Alternative", "Answer", "AsyncClient", "AsyncStream", "Client", "Delta", "Reconnect", "Stream",
           "TokenLogprob", "Verdict", "errors"]

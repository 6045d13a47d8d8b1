"""TLS inside the mesh: `keel certs` + KEEL_MESH_TLS_DIR put every hop on TLS, and the internal
stages on mutual TLS: without the mesh's client certificate nobody reaches them, token or not."""
from __future__ import annotations

import ssl

import grpc
import openai
import pytest

from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from keelctl import certs
from keelctl.ask import DEV_API_KEY, ask
from shared import tls
from shared.config import ConfigError
from shared.meshauth import HEADER as MESH_TOKEN_KEY
from shared.modelfile import model_id
from testing.mesh import start_mesh, stop_mesh

MODEL_ID = model_id()  # the served model's name (shared/modelfile.py)


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    folder = certs.make(tmp / "certs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tls.ENV, str(folder))  # the mesh inherits it; this process's calls use it too
        mesh = start_mesh(tmp, tokenizer_workers=1)
        yield mesh, folder
        stop_mesh(mesh)


def encode(channel, token: str) -> tokenizer_pb2.EncodeResponse:
    return tokenizer_pb2_grpc.TokenizerStub(channel).Encode(
        tokenizer_pb2.EncodeRequest(text=b"hello"), metadata=((MESH_TOKEN_KEY, token),), timeout=10)


def test_a_request_crosses_the_mesh_over_tls(tls_mesh, gateway_request):
    mesh, _ = tls_mesh
    resp = ask(mesh.gateway, gateway_request("What is the capital of France?", max_tokens=8))
    assert resp.usage.completion_tokens > 0 and len(resp.trace_id) == 32


def test_plaintext_reaches_no_stage(tls_mesh):
    mesh, _ = tls_mesh
    for target, _service in mesh.targets().values():
        with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as exc:
            encode(ch, mesh.state()["mesh_token"])
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stages_demand_the_client_certificate(tls_mesh):
    mesh, folder = tls_mesh
    target = f"127.0.0.1:{mesh.ports['tokenizer'][0]}"
    server_only = grpc.ssl_channel_credentials(root_certificates=(folder / "ca.pem").read_bytes())
    with grpc.secure_channel(target, server_only) as ch, pytest.raises(grpc.RpcError) as exc:
        encode(ch, mesh.state()["mesh_token"])
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with tls.sync_channel(target) as ch:  # the client certificate, and the token still required
        assert list(encode(ch, mesh.state()["mesh_token"]).input_ids)
        with pytest.raises(grpc.RpcError) as exc:
            encode(ch, "wrong-token")
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_gateway_takes_tls_without_a_client_certificate(tls_mesh, gateway_request):
    mesh, folder = tls_mesh
    server_only = grpc.ssl_channel_credentials(root_certificates=(folder / "ca.pem").read_bytes())
    with grpc.secure_channel(mesh.gateway, server_only) as ch:
        resp = mesh.stub(ch).Generate(gateway_request("hi", max_tokens=2),
                                      metadata=(("x-api-key", "keel-dev-key"),), timeout=60)
    assert resp.usage.completion_tokens > 0


def test_missing_certificates_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv(tls.ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="ca.pem.*make certs"):
        tls.channel_credentials()


def test_cli_names_missing_certificates_instead_of_a_traceback(tmp_path, monkeypatch, capsys):
    from keelctl.main import main
    monkeypatch.setenv(tls.ENV, str(tmp_path))
    assert main(["ask", "hi"]) == 2
    assert "lacks ca.pem" in capsys.readouterr().err


def test_the_http_api_serves_https_with_the_mesh_certificate(tls_mesh):
    mesh, folder = tls_mesh
    ctx = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    client = openai.OpenAI(base_url=f"https://{mesh.http}/v1", api_key=DEV_API_KEY, max_retries=0, timeout=300,
                           http_client=openai.DefaultHttpxClient(verify=ctx))
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.usage.completion_tokens > 0 and len(r.id) == len("chatcmpl-") + 32
    plain = openai.OpenAI(base_url=f"http://{mesh.http}/v1", api_key=DEV_API_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.APIConnectionError):
        plain.models.list()

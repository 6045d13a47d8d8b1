"""Failed authentications are limited per peer with backoff; a request presenting more than one
API key is refused. Unit tests on a fake clock, then the gateway's real authentication behind the
real server interceptor on a loopback port."""
from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
import yaml

from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway import config as gateway_config
from services.gateway.auth import ApiKeyAuthenticator, ApiKeyEntry, client_peer, hash_key, peer_host
from services.gateway.ratelimit import AuthFailureLimit, AuthFailureLimiter
from services.gateway.server import GatewayStage
from shared import client, proxyauth
from shared.errors import AMBIGUOUS_API_KEY, AUTH_FAILURES_LIMITED, Overloaded, Unauthenticated
from shared.interceptor import ServerInterceptor

KEY = "keel_alpha_0123456789abcdef"
OTHER_KEY = "keel_beta_fedcba9876543210"
PEER = "ipv4:10.0.0.7:5123"


@pytest.fixture
def auth(clock):
    limiter = AuthFailureLimiter(AuthFailureLimit(max_failures=3, window_s=60, backoff_base_s=1,
                                                  backoff_cap_s=8), clock=clock)
    return ApiKeyAuthenticator([ApiKeyEntry("team-a", hash_key(KEY)), ApiKeyEntry("team-b", hash_key(OTHER_KEY))],
                               limiter)


def guess(auth, peer=PEER, key="wrong"):
    auth.authenticate({"x-api-key": key}, peer)


def test_after_max_failures_the_peer_is_refused_with_a_retry_hint(auth, clock):
    for _ in range(3):
        with pytest.raises(Unauthenticated):
            guess(auth)
    with pytest.raises(Overloaded) as info:
        guess(auth, key=KEY)       # even the right key: guesses from a blocked peer are not tried
    assert info.value.reason == AUTH_FAILURES_LIMITED and info.value.code == "RESOURCE_EXHAUSTED"
    assert info.value.retry_after_ms == 2000  # blocked 1 s, doubled by this try
    clock.advance(2.0)
    assert auth.authenticate({"x-api-key": KEY}, PEER) == "team-a"


def test_a_blocked_address_still_admits_keys_that_authenticated_from_it(auth, clock):
    """Clients behind one NAT: team-a and team-b work from the address, then a third client there
    floods wrong keys. The address is blocked for guesses, not for the keys already seen there."""
    assert auth.authenticate({"x-api-key": KEY}, "ipv4:10.0.0.7:1") == "team-a"
    assert auth.authenticate({"x-api-key": OTHER_KEY}, "ipv4:10.0.0.7:2") == "team-b"
    for _ in range(20):
        try:
            guess(auth)
        except (Unauthenticated, Overloaded):
            pass
    with pytest.raises(Overloaded):
        guess(auth)
    assert auth.authenticate({"x-api-key": KEY}, "ipv4:10.0.0.7:3") == "team-a"
    assert auth.authenticate({"authorization": f"Bearer {OTHER_KEY}"}, PEER) == "team-b"
    with pytest.raises(Overloaded):   # a bad header from a blocked address is refused, not tried
        auth.authenticate((("x-api-key", KEY), ("x-api-key", OTHER_KEY)), PEER)


def test_keys_remembered_per_address_are_bounded(clock):
    limiter = AuthFailureLimiter(AuthFailureLimit(max_failures=1, max_keys_per_peer=2), clock=clock)
    for key_id in ("a", "b", "c"):
        limiter.succeeded("h", key_id)
    assert limiter.known_keys("h") == {"b", "c"}
    assert limiter.known_keys("elsewhere") == frozenset()


def test_backoff_doubles_with_each_further_failure_up_to_the_cap(auth, clock):
    for _ in range(3):
        with pytest.raises(Unauthenticated):
            guess(auth)
    hints = []
    for _ in range(4):
        clock.advance(60)   # each block waited out: the next guess is tried, fails, and blocks longer
        with pytest.raises(Unauthenticated):
            guess(auth)
        with pytest.raises(Overloaded) as info:
            auth.authenticate({"x-api-key": KEY}, "ipv4:10.0.0.7:1")  # another key (prefix), same address
        hints.append(info.value.retry_after_ms)
    # the refused try counts too: 4th failure blocks 2 s, the refused try doubles it to 4 s; ...
    assert hints == [4000, 8000, 8000, 8000]


def test_tries_while_blocked_escalate_the_block(auth, clock):
    """Issue 44: a client that ignored the hint got Retry-After: 1 even after 100 failures."""
    hints = []
    for i in range(100):
        try:
            guess(auth, key=f"guess-{i}")
        except Overloaded as exc:
            hints.append(exc.retry_after_ms)
        except Unauthenticated:
            pass
        clock.advance(0.01)
    assert hints[0] == 2000 and hints[-1] == 8000  # 1 s doubled by the try itself, then the cap


def test_guesses_at_one_key_from_many_addresses_are_cut_off_by_its_prefix(auth):
    """Rotating addresses does not buy guesses at one key's completion: failures also count per
    key prefix, and the key's own holder (who authenticated with it before) is still admitted."""
    assert auth.authenticate({"x-api-key": KEY}, "ipv4:192.0.2.1:1") == "team-a"
    stem = KEY[:12]
    answers = []
    for i in range(6):
        try:
            guess(auth, peer=f"ipv4:10.9.0.{i}:1", key=f"{stem}-guess-{i}")
        except (Unauthenticated, Overloaded) as exc:
            answers.append(exc.reason)
    assert answers[:3] == ["INVALID_API_KEY"] * 3 and set(answers[3:]) == {AUTH_FAILURES_LIMITED}
    assert auth.authenticate({"x-api-key": KEY}, "ipv4:10.9.0.99:1") == "team-a"   # the holder, anywhere
    assert auth.authenticate({"x-api-key": OTHER_KEY}, "ipv4:10.9.0.0:1") == "team-b"  # other keys: unaffected


def test_peers_are_counted_by_address_not_by_connection(auth):
    for port in range(3):
        with pytest.raises(Unauthenticated):
            guess(auth, peer=f"ipv4:10.0.0.7:{6000 + port}")
    with pytest.raises(Overloaded):
        guess(auth, peer="ipv4:10.0.0.7:7000")
    assert auth.authenticate({"x-api-key": KEY}, "ipv4:10.0.0.8:7000") == "team-a"  # others unaffected


def test_failures_are_forgotten_after_a_quiet_window(auth, clock):
    for _ in range(2):
        with pytest.raises(Unauthenticated):
            guess(auth)
    clock.advance(61)
    for _ in range(2):
        with pytest.raises(Unauthenticated):
            guess(auth)          # the count started again: no block yet


def test_tracked_peers_are_bounded(clock):
    limiter = AuthFailureLimiter(AuthFailureLimit(max_failures=1, max_peers=2), clock=clock)
    for host in ("a", "b", "c"):
        limiter.failed(host)
    assert limiter.refusal("a") is None      # forgotten: the oldest went first
    assert isinstance(limiter.refusal("c"), Overloaded)


@pytest.mark.parametrize("metadata", [
    (("x-api-key", KEY), ("x-api-key", "other")),
    (("x-api-key", KEY), ("x-api-key", KEY)),
    (("x-api-key", KEY), ("authorization", "Bearer other")),
    (("authorization", f"Bearer {KEY}"), ("authorization", "Bearer other")),
])
def test_more_than_one_key_is_refused_and_counted(auth, metadata):
    with pytest.raises(Unauthenticated) as info:
        auth.authenticate(metadata, PEER)
    assert info.value.reason == AMBIGUOUS_API_KEY


def test_the_same_key_in_both_headers_is_accepted(auth):
    assert auth.authenticate((("x-api-key", KEY), ("authorization", f"Bearer {KEY}")), PEER) == "team-a"


@pytest.mark.parametrize("peer,host", [("ipv4:127.0.0.1:5000", "127.0.0.1"), ("ipv6:[::1]:5000", "::1"),
                                       ("ipv6:%5B::1%5D:5000", "::1"), ("unix:/tmp/s", "unix:/tmp/s")])
def test_peer_host_drops_the_port(peer, host):
    assert peer_host(peer) == host


class Echo(tokenizer_pb2_grpc.TokenizerServicer):
    async def Decode(self, request, context):
        return tokenizer_pb2.DecodeResponse(text="ok")


def shipped_config() -> dict:
    with open("config/gateway.yaml") as f:
        return yaml.safe_load(f)


def stage_with(tmp_path, cfg: dict) -> GatewayStage:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return GatewayStage(gateway_config.load(path))


@pytest_asyncio.fixture
async def gateway_channel(tmp_path):
    """The gateway stage's own authenticate (keys and limits from config/gateway.yaml) behind the
    real interceptor, in front of a trivial servicer. The first block lasts the backoff cap, so
    that a slow machine taking longer than the shipped 1 s base over 200 calls cannot let a guess
    through mid-test (which the limiter rightly allows once the backoff has passed)."""
    cfg = shipped_config()
    cfg["auth_failures"]["backoff_base_s"] = cfg["auth_failures"]["backoff_cap_s"]
    stage = stage_with(tmp_path, cfg)
    srv = grpc.aio.server(interceptors=[ServerInterceptor("gateway", authenticate=stage.authenticate)])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(Echo(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield ch, stage.cfg.auth_failures
    await ch.close()
    await srv.stop(None)


async def status_of(ch, md):
    try:
        await tokenizer_pb2_grpc.TokenizerStub(ch).Decode(tokenizer_pb2.DecodeRequest(ids=[1]), metadata=md)
        return grpc.StatusCode.OK, None
    except grpc.aio.AioRpcError as exc:
        return exc.code(), client.translate(exc)


@pytest.mark.asyncio
async def test_200_wrong_keys_from_one_address_are_cut_off(gateway_channel):
    ch, limit = gateway_channel
    answers = [await status_of(ch, (("x-api-key", f"guess-{i}"),)) for i in range(200)]
    codes = [code for code, _ in answers]
    assert codes[:limit.max_failures] == [grpc.StatusCode.UNAUTHENTICATED] * limit.max_failures
    assert set(codes[limit.max_failures:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    err = answers[-1][1]
    assert err.reason == AUTH_FAILURES_LIMITED and err.retry_after_ms > 0


@pytest.mark.asyncio
async def test_a_key_flooding_an_address_does_not_limit_another_key_from_it(tmp_path):
    """Two keys behind one address: one floods past its rate limit and sends wrong keys until the
    address is blocked; the other keeps being served throughout."""
    cfg = shipped_config()
    cfg["auth_failures"]["backoff_base_s"] = cfg["auth_failures"]["backoff_cap_s"]
    cfg["api_keys"] = [{"key_id": "flooder", "key_hash": hash_key(KEY)},
                       {"key_id": "neighbour", "key_hash": hash_key(OTHER_KEY)}]
    cfg["rate_limits"] = {"default": {"rate_per_s": 1, "burst": 5}, "per_key": {}}
    stage = stage_with(tmp_path, cfg)
    srv = grpc.aio.server(interceptors=[ServerInterceptor("gateway", authenticate=stage.authenticate)])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(Echo(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert (await status_of(ch, (("x-api-key", OTHER_KEY),)))[0] == grpc.StatusCode.OK
            flood = [await status_of(ch, (("x-api-key", KEY),)) for _ in range(30)]
            assert {e.reason for _, e in flood if e is not None} == {"RATE_LIMITED"}
            assert (await status_of(ch, (("x-api-key", OTHER_KEY),)))[0] == grpc.StatusCode.OK
            guesses = [await status_of(ch, (("x-api-key", f"wrong-{i}"),)) for i in range(30)]
            assert guesses[-1][1].reason == AUTH_FAILURES_LIMITED
            assert (await status_of(ch, (("x-api-key", OTHER_KEY),)))[0] == grpc.StatusCode.OK
            assert (await status_of(ch, (("x-api-key", "wrong-again"),)))[1].reason == AUTH_FAILURES_LIMITED
    finally:
        await srv.stop(None)


@pytest.mark.asyncio
async def test_two_api_key_headers_are_refused_over_the_wire(gateway_channel):
    ch, _ = gateway_channel
    code, err = await status_of(ch, (("x-api-key", "keel-dev-key"), ("x-api-key", "other")))
    assert code == grpc.StatusCode.UNAUTHENTICATED and err.reason == AMBIGUOUS_API_KEY
    assert (await status_of(ch, (("x-api-key", "keel-dev-key"),)))[0] == grpc.StatusCode.OK


PROXY = "proxy-secret-0123"


@pytest.mark.parametrize("metadata,expected", [
    (((proxyauth.HEADER, PROXY), (proxyauth.CLIENT_HEADER, "10.1.2.3")), "client:10.1.2.3"),
    (((proxyauth.HEADER, "wrong"), (proxyauth.CLIENT_HEADER, "10.1.2.3")), PEER),   # not the proxy
    (((proxyauth.CLIENT_HEADER, "10.1.2.3"),), PEER),                              # no credential at all
    (((proxyauth.HEADER, PROXY),), PEER),                                          # names no client
])
def test_only_the_proxy_credential_lets_a_caller_name_the_client_it_calls_for(metadata, expected):
    assert client_peer(metadata, PEER, PROXY) == expected
    assert client_peer(metadata, PEER, None) == PEER  # a gateway without a proxy token believes nobody


@pytest.mark.asyncio
async def test_one_http_client_guessing_keys_does_not_lock_out_the_others_behind_the_same_server(
        tmp_path, monkeypatch):
    """The OpenAI server calls the gateway from one address for all its clients; it names each
    client beside the proxy credential. A client flooding wrong keys is cut off; a client whose key
    never authenticated before, behind the same server, is still served. A caller without the
    credential cannot pick the address its failures count against."""
    monkeypatch.setenv(proxyauth.ENV, PROXY)
    cfg = shipped_config()
    cfg["auth_failures"]["backoff_base_s"] = cfg["auth_failures"]["backoff_cap_s"]
    cfg["api_keys"] = [{"key_id": "newcomer", "key_hash": hash_key(KEY)}]
    stage = stage_with(tmp_path, cfg)
    srv = grpc.aio.server(interceptors=[ServerInterceptor("gateway", authenticate=stage.authenticate)])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(Echo(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    limit = stage.cfg.auth_failures.max_failures
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            flooder = ((proxyauth.HEADER, PROXY), (proxyauth.CLIENT_HEADER, "203.0.113.9"))
            guesses = [await status_of(ch, (*flooder, ("x-api-key", f"wrong-{i}"))) for i in range(limit + 5)]
            assert guesses[-1][1].reason == AUTH_FAILURES_LIMITED
            neighbour = ((proxyauth.HEADER, PROXY), (proxyauth.CLIENT_HEADER, "198.51.100.4"), ("x-api-key", KEY))
            assert (await status_of(ch, neighbour))[0] == grpc.StatusCode.OK
            forged = ((proxyauth.HEADER, "forged"), (proxyauth.CLIENT_HEADER, "192.0.2.1"))
            for i in range(limit + 1):  # counted against the transport peer, 127.0.0.1
                await status_of(ch, (*forged, ("x-api-key", f"forged-{i}")))
            assert (await status_of(ch, (("x-api-key", "another"),)))[1].reason == AUTH_FAILURES_LIMITED
    finally:
        await srv.stop(None)

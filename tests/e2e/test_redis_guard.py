"""The mesh's Redis under `keel up`: it refuses a client without the per-run password (which only
the validator and the 0600 state file have), runs with a memory cap and never evicts."""
from __future__ import annotations

import pytest
import redis

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_redis_needs_the_password_and_never_evicts(mesh):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=mesh.redis_port).ping()
    url = mesh.state()["redis_url"]
    assert str(mesh.redis_port) in url and url.startswith("redis://:")
    client = redis.Redis.from_url(url, decode_responses=True)
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert int(client.config_get("maxmemory")["maxmemory"]) == 256 * 1024 * 1024

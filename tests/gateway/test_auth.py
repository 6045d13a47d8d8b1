"""API key hashing and checking, the mesh credential and the hashing CLI."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from services.gateway.auth import ApiKeyAuthenticator, ApiKeyEntry, hash_key, header_value, main
from shared.errors import Unauthenticated

ROOT = Path(__file__).resolve().parents[2]
KEY_A = "keel_alpha_0123456789abcdef"
KEY_B = "keel_beta_fedcba9876543210"


@pytest.fixture
def auth():
    return ApiKeyAuthenticator([
        ApiKeyEntry("team-a", hash_key(KEY_A)),
        ApiKeyEntry("team-b", hashlib.sha256(KEY_B.encode()).hexdigest()),  # unsalted, by hand
    ])


def test_hash_key_is_salted_and_reproducible_with_the_same_salt():
    salt = bytes(range(16))
    stored = hash_key(KEY_A, salt=salt)
    assert stored == f"sha256${salt.hex()}${hashlib.sha256(salt + KEY_A.encode()).hexdigest()}"
    assert hash_key(KEY_A) != hash_key(KEY_A)  # fresh salt each time
    assert KEY_A not in stored
    with pytest.raises(ValueError):
        hash_key("")


@pytest.mark.parametrize("metadata,key_id", [
    ({"x-api-key": KEY_A}, "team-a"),
    ((("authorization", f"Bearer {KEY_B}"),), "team-b"),
    ((("Authorization", f"bearer  {KEY_A} "),), "team-a"),
    ((("x-api-key", KEY_B.encode()),), "team-b"),
])
def test_valid_keys_return_their_id(auth, metadata, key_id):
    assert auth.authenticate(metadata) == key_id


@pytest.mark.parametrize("metadata", [
    None, {}, {"x-api-key": ""}, {"authorization": "Basic abc"}, {"authorization": "Bearer "},
    (("x-other", KEY_A),),
])
def test_missing_key(auth, metadata):
    with pytest.raises(Unauthenticated) as info:
        auth.authenticate(metadata)
    assert info.value.reason == "MISSING_API_KEY" and info.value.code == "UNAUTHENTICATED"


@pytest.mark.parametrize("key", [KEY_A + "x", KEY_A[:-1], KEY_A.upper(), "wrong", hash_key(KEY_A)])
def test_wrong_key(auth, key):
    with pytest.raises(Unauthenticated) as info:
        auth.authenticate({"x-api-key": key})
    assert info.value.reason == "INVALID_API_KEY"
    assert key not in str(info.value)


@pytest.mark.parametrize("entries", [
    [ApiKeyEntry("a", "md5$00$abc")],
    [ApiKeyEntry("a", "sha256$zz$" + "0" * 64)],
    [ApiKeyEntry("a", "sha256$00$" + "0" * 63)],
    [ApiKeyEntry("a", "0" * 63)],
    [ApiKeyEntry("", hash_key(KEY_A))],
    [ApiKeyEntry("a", hash_key(KEY_A)), ApiKeyEntry("a", hash_key(KEY_B))],
])
def test_bad_config_is_rejected_at_startup(entries):
    with pytest.raises(ValueError):
        ApiKeyAuthenticator(entries)


def test_no_keys_configured_rejects_everyone():
    with pytest.raises(Unauthenticated) as info:
        ApiKeyAuthenticator([]).authenticate({"x-api-key": KEY_A})
    assert info.value.reason == "INVALID_API_KEY"


def test_header_value_first_match_case_insensitive():
    md = (("X-Api-Key", "one"), ("x-api-key", "two"))
    assert header_value(md, "x-api-key") == "one"
    assert header_value(md, "missing") is None


def test_cli_hash_output_verifies(capsys):
    assert main(["hash", KEY_A]) == 0
    stored = capsys.readouterr().out.strip()
    assert ApiKeyAuthenticator([ApiKeyEntry("cli", stored)]).authenticate({"x-api-key": KEY_A}) == "cli"


def test_cli_new_prints_a_key_that_matches_its_hash(capsys):
    assert main(["new"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    auth = ApiKeyAuthenticator([ApiKeyEntry("new", lines["hash"].strip())])
    assert auth.authenticate({"x-api-key": lines["key"].strip()}) == "new"


def test_cli_runs_as_a_module_and_reads_stdin():
    proc = subprocess.run([sys.executable, "-m", "services.gateway.auth", "hash", "-"], cwd=ROOT,
                          input=KEY_B + "\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    auth = ApiKeyAuthenticator([ApiKeyEntry("b", proc.stdout.strip())])
    assert auth.authenticate({"x-api-key": KEY_B}) == "b"
    empty = subprocess.run([sys.executable, "-m", "services.gateway.auth", "hash", "-"], cwd=ROOT,
                           input="\n", capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2

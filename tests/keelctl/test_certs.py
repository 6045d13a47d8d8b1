"""keelctl/certs.py: the server certificate names every stage, so that a client can verify any of
them by its compose / Kubernetes service name (the HTTP API's included), and loopback."""
from __future__ import annotations

import ssl

from keelctl import certs
from shared.stages import STAGE_ORDER


def test_the_server_certificate_names_every_stage_and_loopback(tmp_path):
    folder = certs.make(tmp_path / "certs")
    decoded = ssl._ssl._test_decode_cert(str(folder / "server.pem"))  # the stdlib's own X.509 parser
    names = set(decoded["subjectAltName"])
    assert {("DNS", stage) for stage in STAGE_ORDER} | {("DNS", "localhost"), ("IP Address", "127.0.0.1")} <= names
    assert ("DNS", "openai") in names and ("DNS", "feedback") in names

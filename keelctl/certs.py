"""Certificates for TLS inside the mesh: one CA, one server certificate shared by the stages and one
client certificate for the callers (gateway, CLI), all P-256, made with the openssl command.

Run: python -m keelctl certs [--out var/certs] [--days 365]   (or `make certs`), then start the mesh
with KEEL_MESH_TLS_DIR=var/certs (see shared/tls.py). Existing files are replaced; the CA's key is
thrown away once the two certificates are signed, so nothing else can ever be signed by it.
"""
from __future__ import annotations

import secrets
import subprocess
import tempfile
from pathlib import Path

from shared.stages import STAGE_ORDER

# Loopback for `keel up`; every stage's bare service name for compose and Kubernetes.
SERVER_NAMES = ",".join(("DNS:localhost", "IP:127.0.0.1", *(f"DNS:{stage}" for stage in STAGE_ORDER)))
KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()}")


def make(out: Path, days: int = 365) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _openssl("req", "-x509", *KEY, "-keyout", str(work / "ca.key"), "-out", str(out / "ca.pem"),
                 "-days", str(days), "-subj", "/CN=keel-mesh-ca")
        for name, ext in (("server", f"subjectAltName={SERVER_NAMES}\nextendedKeyUsage=serverAuth\n"),
                          ("client", "extendedKeyUsage=clientAuth\n")):
            (work / f"{name}.ext").write_text(ext)
            _openssl("req", *KEY, "-keyout", str(out / f"{name}.key"), "-out", str(work / f"{name}.csr"),
                     "-subj", f"/CN=keel-{name}")
            _openssl("x509", "-req", "-in", str(work / f"{name}.csr"), "-CA", str(out / "ca.pem"),
                     "-CAkey", str(work / "ca.key"), "-set_serial", str(secrets.randbits(63)),
                     "-out", str(out / f"{name}.pem"),
                     "-days", str(days), "-extfile", str(work / f"{name}.ext"))
            (out / f"{name}.key").chmod(0o600)
    return out

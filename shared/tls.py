"""TLS between the stages, switched on for a whole mesh by one variable: KEEL_MESH_TLS_DIR, a folder
made by `make certs` (`python -m keelctl certs`) holding ca.pem, server.pem/.key and client.pem/.key.

With it set, every stage serves TLS with the server certificate; the internal stages also demand a
client certificate signed by the mesh CA (mTLS), so only the gateway and the CLI, which hold the
client certificate, can call them. The gateway itself asks for none: its clients are authenticated
by API key. Unset, everything is plaintext on loopback and the mesh token alone guards the stages.
"""
from __future__ import annotations

import os
from pathlib import Path

import grpc

from shared.config import ConfigError

ENV = "KEEL_MESH_TLS_DIR"
FILES = ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")


def mesh_dir() -> Path | None:
    """The certificate folder when TLS is on; a missing file is a ConfigError naming it."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    folder = Path(raw)
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"{ENV}={folder} lacks {', '.join(missing)}; run `make certs`")
    return folder


def server_credentials(*, mutual: bool) -> grpc.ServerCredentials | None:
    folder = mesh_dir()
    if folder is None:
        return None
    pair = [((folder / "server.key").read_bytes(), (folder / "server.pem").read_bytes())]
    return grpc.ssl_server_credentials(pair, root_certificates=(folder / "ca.pem").read_bytes(),
                                       require_client_auth=mutual)


def channel_credentials() -> grpc.ChannelCredentials | None:
    folder = mesh_dir()
    if folder is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=(folder / "ca.pem").read_bytes(),
                                        private_key=(folder / "client.key").read_bytes(),
                                        certificate_chain=(folder / "client.pem").read_bytes())


def sync_channel(target: str) -> grpc.Channel:
    """A blocking channel (the CLI's), over TLS with the client certificate when the mesh uses it."""
    creds = channel_credentials()
    return grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)

"""ZeroMQ CURVE keys of one job, and the authenticator of nereusd's control plane.

Each job gets two key pairs, generated once in ``RUN_DIR/keys/`` (directory mode 0700, files
0600, created with ``O_EXCL`` so an existing key is never overwritten or read from a file that
others could have written): the *server* pair of nereusd and the *client* pair that the job's
agents and ``nereus-launch status`` use. Whoever can read the run directory's key files is the
job's user; nobody else can complete a CURVE handshake with nereusd (ZAP checks the client's
public key), and a peer without CURVE cannot connect at all. Traffic is encrypted.

Source: ZeroMQ RFC 26 (CurveZMQ) and RFC 27 (ZAP); pyzmq ``zmq.auth``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from nereusd.errors import NereusError

log = logging.getLogger(__name__)

KEYS_DIR = "keys"
SERVER_FILE = "server.json"
CLIENT_FILE = "client.json"
ZAP_DOMAIN = "nereus"


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, Z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes


@dataclass(frozen=True)
class JobKeys:
    """The keys a process of the job needs: its own pair and the server's public key."""

    own: KeyPair
    server_public: bytes
    client_public: bytes


def _write_private(path: Path, data: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)


def _check_private(path: Path) -> None:
    st = path.stat()
    if st.st_uid != os.getuid():
        raise NereusError(f"{path}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise NereusError(f"{path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it; expected 600 (700 for the directory)")


def init_keys(run_dir: str | os.PathLike) -> Path:
    """Create the job's key files under ``run_dir/keys`` unless they exist; returns that directory.

    Raises:
        NereusError: existing keys are not private to this user (mode or owner).
    """
    directory = Path(run_dir) / KEYS_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(directory)
    server, client = directory / SERVER_FILE, directory / CLIENT_FILE
    if not server.exists():
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        _write_private(server, {"public": spub.decode(), "secret": ssec.decode(), "client_public": cpub.decode()})
        _write_private(client, {"public": cpub.decode(), "secret": csec.decode(), "server_public": spub.decode()})
        log.info("generated CURVE keys in %s", directory)
    return directory


def load_keys(keys_dir: str | os.PathLike, role: str) -> JobKeys:
    """Load the ``server`` (nereusd) or ``client`` (agent, CLI) keys of a job.

    Raises:
        NereusError: missing or unreadable key files, files readable by others, bad contents.
    """
    directory = Path(keys_dir)
    path = directory / (SERVER_FILE if role == "server" else CLIENT_FILE)
    try:
        _check_private(directory)
        _check_private(path)
        data = json.loads(path.read_text())
        own = KeyPair(data["public"].encode(), data["secret"].encode())
        if role == "server":
            return JobKeys(own, server_public=own.public, client_public=data["client_public"].encode())
        return JobKeys(own, server_public=data["server_public"].encode(), client_public=own.public)
    except FileNotFoundError:
        raise NereusError(f"{path}: no such key file (create it with `python -m nereusd.daemon.security init RUN_DIR`)") from None
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise NereusError(f"{path}: not a Nereus key file: {err!r}") from None


def make_client(sock: zmq.Socket, keys: JobKeys) -> None:
    """Configure a DEALER (agent, CLI) to talk CURVE to nereusd (before ``connect``)."""
    sock.curve_publickey = keys.own.public
    sock.curve_secretkey = keys.own.secret
    sock.curve_serverkey = keys.server_public


class ServerAuth:
    """nereusd's side: a CURVE server socket whose ZAP handler admits only the job's client key.

    Refused handshakes (wrong key, no CURVE at all) come from the socket's monitor, which the
    control plane reads (:data:`REFUSED_EVENTS`, :meth:`describe`); nereusd keeps running.
    """

    REFUSED_EVENTS = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed",
                      zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error (no CURVE?)",
                      zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed"}
    """Monitor events of a refused handshake, and what they mean."""

    def __init__(self, ctx: zmq.Context, keys: JobKeys) -> None:
        self.keys = keys
        deadline = time.monotonic() + 5.0
        while True:   # the ZAP address of a control plane closed just before is freed by libzmq's reaper, later
            self.authenticator = ThreadAuthenticator(ctx, log=logging.getLogger("nereusd.daemon.security.zap"))
            try:
                self.authenticator.start()
                break
            except zmq.ZMQError as err:
                self.authenticator.stop()
                if err.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        allowed = {keys.client_public}

        class _Provider:
            def callback(self, domain: str, key: bytes) -> bool:
                ok = key in allowed
                if not ok:
                    log.warning("refused a CURVE client with an unknown public key %s", key[:8].decode(errors="replace"))
                return ok

        self.authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_Provider())

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server (before ``bind``)."""
        sock.curve_server = True
        sock.curve_publickey = self.keys.own.public
        sock.curve_secretkey = self.keys.own.secret
        sock.zap_domain = ZAP_DOMAIN.encode()

    @classmethod
    def describe(cls, event: dict) -> str | None:
        """A refused handshake's monitor event as text (``authentication failed (code 400) on
        tcp://…``); ``None`` for other events."""
        name = cls.REFUSED_EVENTS.get(event["event"])
        if name is None:
            return None
        return f"{name} (code {event['value']}) on {event['endpoint'].decode(errors='replace')}"

    def close(self) -> None:
        self.authenticator.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nereusd.daemon.security", description="CURVE keys of a Nereus job.")
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="create RUN_DIR/keys (mode 0700, files 0600) unless present")
    init.add_argument("run_dir")
    args = parser.parse_args(argv)
    try:
        print(init_keys(args.run_dir))
    except NereusError as err:
        print(f"nereusd.daemon.security: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

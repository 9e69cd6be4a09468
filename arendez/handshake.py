"""The handshake that opens every arendez connection (store clients, the lease keeper, peer
links): the acceptor challenges with a nonce, the connector answers with its hello and, when a
token is configured, an HMAC proof of it; the acceptor proves it back. The token never crosses
the wire. Sans-I/O halves (``answer_challenge``/``check_welcome`` for connectors,
``make_challenge``/``answer_hello`` for acceptors) serve blocking sockets and the server's
callbacks; ``client_handshake``/``server_handshake`` run them over a ``Connection``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from .errors import AuthenticationError, ProtocolError
from .transport import Connection, describe_peer, remote_error

PROTOCOL_VERSION = 1


def _proof(token: str, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(token.encode(), role + nonce, hashlib.sha256).digest()


endpoint = describe_peer  # (the name its callers know)


def answer_challenge(
    challenge: Any, token: str | None, hello: dict[str, Any], peer: Any
) -> tuple[dict[str, Any], bytes]:
    """Sans-I/O half of the client handshake: check the acceptor's challenge, build our reply.

    Returns the reply frame and the nonce the acceptor must answer with its own proof.
    """
    peer = endpoint(peer)
    if isinstance(challenge, dict) and "error" in challenge and "hello" not in challenge:
        raise remote_error(challenge, ProtocolError)  # refused before the handshake (a limit)
    if not isinstance(challenge, dict) or challenge.get("hello") != "arendez":
        raise ProtocolError(f"{peer} is not an arendez endpoint")
    if challenge.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"{peer} speaks protocol {challenge.get('v')}, not {PROTOCOL_VERSION}")
    if challenge.get("auth") and not token:
        raise AuthenticationError(
            f"{peer} requires a token and none was given (init_process_group: the URL's token@, "
            "or ARENDEZ_TOKEN; Store and BlockingStore: their token= argument)"
        )
    if token and not challenge.get("auth"):
        raise AuthenticationError(
            f"{peer} runs without a token but this side has one: refusing to trust an endpoint "
            "that does not check it (give the server the same token, or drop it here)"
        )
    if not isinstance(challenge.get("nonce"), bytes):
        raise ProtocolError(f"{peer} sent a malformed challenge")
    nonce = os.urandom(16)
    reply = dict(hello)
    reply["nonce"] = nonce
    if token:
        reply["proof"] = _proof(token, challenge["nonce"], b"client")
    return reply, nonce


def early_welcome(challenge: dict[str, Any], token: str | None) -> dict[str, Any] | None:
    """The welcome an acceptor without a token sent ahead, in its challenge (``"early"``), or
    None. A connector that takes it says so in its hello (``"early": True``): the acceptor then
    sends no welcome, so the connector may send requests right behind its hello, and the
    handshake costs one message and one wake-up less on each side. With a token the acceptor must
    prove itself in its welcome, and no welcome comes early."""
    early = challenge.get("early")
    if token or not isinstance(early, dict):
        return None
    return early


def check_welcome(welcome: Any, token: str | None, nonce: bytes, peer: Any) -> dict[str, Any]:
    """Sans-I/O second half: the acceptor's answer must carry its proof (when there is a token)."""
    peer = endpoint(peer)
    if not isinstance(welcome, dict):
        raise ProtocolError(f"{peer} sent a malformed handshake")
    if "error" in welcome:
        raise remote_error(welcome, AuthenticationError)
    if token:
        proof = welcome.get("proof")
        if not isinstance(proof, bytes) or not hmac.compare_digest(_proof(token, nonce, b"server"), proof):
            raise AuthenticationError(f"{peer} could not prove it knows the token (a different token?)")
    return welcome


async def client_handshake(
    conn: Connection, token: str | None, hello: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """Prove we know ``token`` (HMAC of the acceptor's nonce) and check that the acceptor does.

    Returns the acceptor's welcome frame. The token itself never crosses the wire.
    """
    challenge, _ = await conn.recv(timeout)
    reply, nonce = answer_challenge(challenge, token, hello, conn.peer)
    early = early_welcome(challenge, token)
    if early is not None:
        reply["early"] = True
        conn.send(reply)
        return early
    conn.send(reply)
    welcome, _ = await conn.recv(timeout)
    return check_welcome(welcome, token, nonce, conn.peer)


def make_challenge(token: str | None, early: dict[str, Any] | None = None) -> tuple[dict[str, Any], bytes]:
    """Sans-I/O first half of the acceptor's handshake: the challenge frame and its nonce;
    ``early``: the welcome, sent ahead when there is no token (``early_welcome``)."""
    nonce = os.urandom(16)
    challenge = {"hello": "arendez", "v": PROTOCOL_VERSION, "nonce": nonce, "auth": bool(token)}
    if early is not None and not token:
        challenge["early"] = early
    return challenge, nonce


def answer_hello(
    hello: Any, token: str | None, nonce: bytes, welcome: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Sans-I/O second half: check the connector's hello against ``nonce``; the welcome to send."""
    if not isinstance(hello, dict) or not isinstance(hello.get("nonce"), bytes):
        raise ProtocolError("malformed handshake")
    answer = dict(welcome or {})
    if token:
        proof = hello.get("proof")
        if not isinstance(proof, bytes) or not hmac.compare_digest(proof, _proof(token, nonce, b"client")):
            raise AuthenticationError("wrong or missing token")
        answer["proof"] = _proof(token, hello["nonce"], b"server")
    answer.setdefault("ok", True)
    return answer


async def server_handshake(
    conn: Connection, token: str | None, timeout: float, welcome: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Challenge the connector; on success return its hello frame and send ``welcome``."""
    challenge, nonce = make_challenge(token)
    conn.send(challenge)
    hello, _ = await conn.recv(timeout)
    conn.send(answer_hello(hello, token, nonce, welcome))
    return dict(hello)

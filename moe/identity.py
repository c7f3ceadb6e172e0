"""Provider identity: ed25519 keys, canonical JSON and domain-separated signatures.

A provider is identified by its ed25519 public key as 64 lowercase hex characters. Every
signed object (agent hello, heartbeat, receipt) is signed over
``domain ‖ 0x00 ‖ canonical_json(body)`` so a signature for one purpose can never be
replayed as another. Canonical JSON: sorted keys, no whitespace, ASCII only (RFC 8785 in
spirit; bodies carry integers and strings only, never floats, so the encoding is stable).

Pure Python + PyNaCl; imports nothing from Django (the agent uses it on any machine).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

PROVIDER_RE = re.compile(r"^[0-9a-f]{64}$")

DOMAIN_HELLO = b"tenzro/moe/agent-hello/v1"
DOMAIN_HEARTBEAT = b"tenzro/moe/heartbeat/v1"
DOMAIN_KV_HANDOFF = b"tenzro/moe/kv-handoff/v1"  # a Prefill agent's chunk sent peer to peer (moe.handoff)


class SignatureError(ValueError):
    """A signature, key or signed body is malformed or does not verify."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise SignatureError(f"JSON object repeats the key {dup[:100]!r}: a signed message must be unambiguous")
    return obj


def loads_signed(text: str | bytes):
    """``json.loads`` for messages whose signature will be checked: an object that repeats a key is
    refused before any verification (parsers disagree on which value wins, so the signer and a
    verifier could read different bodies). ``NaN``/``Infinity`` are refused as every JSON
    surface of the site refuses them (``moe.jsonrpc.loads``). Raises ``SignatureError`` for a
    repeated key and ``ValueError`` / ``RecursionError`` as ``json.loads`` does."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (non-finite numbers are refused)")


def canonical_json(body: dict) -> bytes:
    """Encode ``body`` as canonical JSON bytes (sorted keys, compact, ASCII).

    Raises ``SignatureError`` when the body holds floats (their text form is not canonical).
    """
    leaf = (int, str)  # the common values: no path string built for them (receipts list every token)

    def check(value, path="body"):
        if isinstance(value, float):
            raise SignatureError(f"{path} is a float; signed bodies carry integers and strings only")
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(v, leaf):
                    check(v, f"{path}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if not isinstance(v, leaf):
                    check(v, f"{path}[{i}]")

    check(body)
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def provider_id(key: SigningKey) -> str:
    """The provider id (64 lowercase hex) of a signing key."""
    return key.verify_key.encode().hex()


def sign(key: SigningKey, domain: bytes, message: bytes) -> str:
    """Sign ``domain ‖ 0x00 ‖ message`` with ed25519; returns the 64-byte signature as hex."""
    return key.sign(domain + b"\x00" + message).signature.hex()


def sign_body(key: SigningKey, domain: bytes, body: dict) -> str:
    """Sign the canonical JSON of ``body`` under ``domain``; returns hex signature."""
    return sign(key, domain, canonical_json(body))


def verify(provider: str, domain: bytes, message: bytes, signature_hex: str) -> None:
    """Check an ed25519 signature by ``provider`` over ``domain ‖ 0x00 ‖ message``.

    Raises ``SignatureError`` naming what is wrong: a malformed provider id, a malformed
    signature, or a signature that does not verify.
    """
    if not isinstance(provider, str) or not PROVIDER_RE.match(provider):
        raise SignatureError("provider must be 64 lowercase hex characters (an ed25519 public key)")
    if not isinstance(signature_hex, str) or not re.fullmatch(r"[0-9a-fA-F]{128}", signature_hex):
        raise SignatureError("signature must be 128 hex characters (64 bytes)")
    try:
        VerifyKey(bytes.fromhex(provider)).verify(domain + b"\x00" + message, bytes.fromhex(signature_hex))
    except BadSignatureError as exc:
        raise SignatureError("signature does not verify for this provider key") from exc
    except Exception as exc:  # nacl raises ValueError/TypeError for keys off the curve
        raise SignatureError(f"provider key is not a valid ed25519 public key: {exc}") from exc


def verify_body(provider: str, domain: bytes, body: dict, signature_hex: str) -> None:
    """Verify a signature over the canonical JSON of ``body``; raises ``SignatureError``."""
    verify(provider, domain, canonical_json(body), signature_hex)


def load_or_create_key(path: str | os.PathLike) -> SigningKey:
    """Load the 32-byte ed25519 seed at ``path`` (raw or hex), creating it (mode 0600) if absent.

    Raises ``ValueError`` when the file exists but holds neither 32 raw bytes nor 64 hex chars.
    """
    p = Path(path)
    if p.exists():
        data = p.read_bytes()
        text = data.strip()
        if len(data) == 32:
            return SigningKey(data)
        if len(text) == 64 and re.fullmatch(rb"[0-9a-fA-F]{64}", text):
            return SigningKey(bytes.fromhex(text.decode()))
        raise ValueError(f"key file {p} must hold a 32-byte ed25519 seed (raw or 64 hex characters)")
    p.parent.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate()
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key.encode().hex())
    try:
        os.link(tmp, p)  # atomic create-if-absent: two starters never get different keys
    except FileExistsError:
        os.unlink(tmp)
        return load_or_create_key(p)
    os.unlink(tmp)
    return key

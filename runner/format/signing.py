"""Ed25519 signatures over artifact manifests: run only what a trusted builder built.

`aot build --sign KEY` writes signature.json beside manifest.json: the signer's public key and a
signature over the sha256 of the manifest's exact bytes. The manifest lists every other file's
sha256, so the signature covers the whole artifact. `aot run --trusted-key PUB` refuses an
artifact unless it is signed by one of the given keys, before anything else is read.
"""

from __future__ import annotations

import json
from pathlib import Path

from runner.errors import AotError
from runner.format.integrity import sha256_bytes

SIGNATURE = "signature.json"
ALGORITHM = "ed25519"


def _crypto():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    return serialization, Ed25519PrivateKey, Ed25519PublicKey


def generate_keypair(private_path: Path) -> Path:
    """Write a new private key (PEM, mode 0600) and its public key beside it (`.pub`, hex)."""
    serialization, Ed25519PrivateKey, _ = _crypto()
    private_path = Path(private_path)
    public_path = private_path.with_name(private_path.name + ".pub")
    for path in (private_path, public_path):
        if path.exists():
            raise AotError(f"{path}: exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    private_path.parent.mkdir(parents=True, exist_ok=True)
    private_path.touch(mode=0o600)
    private_path.write_bytes(pem)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    public_path.write_text(raw.hex() + "\n")
    return public_path


def sign_manifest(manifest_bytes: bytes, private_path: Path) -> bytes:
    """The signature.json content for these exact manifest bytes."""
    serialization, Ed25519PrivateKey, _ = _crypto()
    try:
        key = serialization.load_pem_private_key(Path(private_path).read_bytes(), password=None)
    except FileNotFoundError:
        raise AotError(f"{private_path}: no such signing key") from None
    except (ValueError, TypeError) as e:
        raise AotError(f"{private_path}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AotError(f"{private_path}: not an Ed25519 key (make one with `aot keygen`)")
    digest = sha256_bytes(manifest_bytes)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return (
        json.dumps({"algorithm": ALGORITHM, "public_key": raw.hex(), "manifest_sha256": digest, "signature": key.sign(digest.encode()).hex()}, indent=1) + "\n"
    ).encode()


def read_public_key(path: Path) -> str:
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        raise AotError(f"{path}: no such public key file") from None
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text.lower()):
        raise AotError(f"{path}: not an aot public key (64 hex digits, as `aot keygen` writes)")
    return text.lower()


def check_signature(root: Path, manifest_bytes: bytes, trusted: list[str]) -> str:
    """Raise unless root/signature.json signs these manifest bytes with a trusted key; returns the key."""
    _, _, Ed25519PublicKey = _crypto()
    from cryptography.exceptions import InvalidSignature

    path = Path(root) / SIGNATURE
    if not path.is_file():
        raise AotError(f"{root}: not signed (no {SIGNATURE}) but --trusted-key was given")
    try:
        sig = json.loads(path.read_text())
        public, signature = sig["public_key"].lower(), bytes.fromhex(sig["signature"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise AotError(f"{path}: malformed signature file") from None
    if sig.get("algorithm") != ALGORITHM:
        raise AotError(f"{path}: signature algorithm {sig.get('algorithm')!r}, expected {ALGORITHM}")
    if public not in trusted:
        raise AotError(f"{root}: signed by key {public[:16]}..., which is not among the trusted keys")
    digest = sha256_bytes(manifest_bytes)
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(signature, digest.encode())
    except (InvalidSignature, ValueError):
        raise AotError(f"{root}: signature does not match manifest.json (altered after signing)") from None
    return public

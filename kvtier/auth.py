"""Cluster keys: an engine serves only KV that a holder of its key wrote.

Anyone who can write a tier's medium (a shared mount, a Redis, a bucket,
another process of the node) could otherwise plant a well-formed object
whose checksums are right and steer every engine that reads it. Where an
operator gives a key file (config ``auth_key_file``, or the environment
variable ``KVTIER_AUTH_KEY_FILE``, which vLLM's worker processes inherit),
every object is sealed as it is first stored and a read serves only objects
whose seal checks out under a key of the file (docs/security.md).

The seal (docs/format.md, "Seal"), for an object whose header bytes up to
and including its nonce are ``head`` and whose payload is ``payload``:

    key id = SHA-256( f("kvtier-key-id") ‖ f(K) )[:8]     names K, reveals nothing of it
    K_obj  = BLAKE2b-256( key=K, f("kvtier-seal") ‖ f(head) )
    tag    = AES-256-GCM( key=K_obj, iv=0^96, plaintext="", aad=payload )   16 bytes: GMAC

Why this construction: BLAKE2b keyed is a PRF, so every header (which holds
the object's key, namespace, layout, payload checksum and a random 16-byte
nonce) gets an AES key of its own that nobody without K can compute, and
GMAC under a key used once authenticates the payload at the speed of the
AES and carry-less-multiply instructions, cheaper per byte than BLAKE3 or
HMAC-SHA256 (what it costs: docs/tuning.md). A forger
either changes the header (a key nobody knows) or keeps it (a one-time key
already spent on other bytes): both fail but with probability about
length/2^128. GCM's nonce rules do not arise: no key is used twice.

Key files hold one key a line, 64 hex digits; ``#`` starts a comment. The
first key seals; all are accepted, so a key is rotated by adding the new one
second on every node, then moving it first, then removing the old one
(``kvtier auth``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from typing import Sequence

from kvtier.errors import ConfigError

KEY_BYTES = 32
KEY_ID_BYTES = 8
NONCE_BYTES = 16
TAG_BYTES = 16
MAX_KEY_FILE = 1 << 16  # a key file is a few lines; more is not one
_U64 = struct.Struct("<Q")
_ZERO_IV = bytes(12)
UNSEALED_ID = bytes(KEY_ID_BYTES)  # the key id of an object written without a key

# Why a read refused an object (kvtier_auth_failures_total{reason}).
UNSEALED = "unsealed"  # no seal: written without a key, or by someone who has none
UNKNOWN_KEY = "unknown_key"  # sealed under a key this node does not hold
BAD_SEAL = "bad_seal"  # the seal does not match: forged, tampered or spliced
SEAL_PROBLEMS = {
    UNSEALED: "written without a key: by a node configured without one, or by someone who has none",
    UNKNOWN_KEY: "sealed with a key this node does not hold: check that every node has the same key file "
                 "(kvtier auth id FILE)",
    BAD_SEAL: "its seal does not match its bytes: forged, or changed after it was written",
}


def _field(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def key_id(key: bytes) -> bytes:
    """The 8 bytes that name ``key`` in every object it seals (and in
    ``kvtier check``'s report): one-way, so safe to print and compare."""
    return hashlib.sha256(_field(b"kvtier-key-id") + _field(key)).digest()[:KEY_ID_BYTES]


class Keyring:
    """The keys a process accepts; the first seals.

    Immutable and thread-safe: ``seal`` and ``check`` hold no state beyond
    the keys (the AES class is imported once, in the constructor).
    """

    def __init__(self, keys: Sequence[bytes]):
        if not keys:
            raise ValueError("a keyring needs at least one key")
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aesgcm = AESGCM
        self._keys: dict[bytes, bytes] = {}
        for k in keys:
            if len(k) != KEY_BYTES:
                raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(k)}")
            kid = key_id(k)
            if kid == UNSEALED_ID:
                raise ValueError("this key's id is all zeros; generate another")
            self._keys.setdefault(kid, k)
        self.write_id = key_id(keys[0])

    @property
    def ids(self) -> tuple[bytes, ...]:
        """Key ids, the sealing key's first."""
        return (self.write_id, *(k for k in self._keys if k != self.write_id))

    def nonce(self) -> bytes:
        return os.urandom(NONCE_BYTES)

    def tag(self, kid: bytes, head: bytes, payload: memoryview | bytes) -> bytes | None:
        """The seal of ``head`` and ``payload`` under key ``kid``; None where
        this ring does not hold that key."""
        key = self._keys.get(kid)
        if key is None:
            return None
        k_obj = hashlib.blake2b(_field(b"kvtier-seal") + _field(head), digest_size=32, key=key).digest()
        # Encrypting nothing with ``payload`` as associated data returns just
        # the GCM tag: GMAC. The GIL is released while it runs.
        return self._aesgcm(k_obj).encrypt(_ZERO_IV, b"", payload)

    def check(self, kid: bytes, head: bytes, payload: memoryview | bytes, tag: bytes) -> str | None:
        """None where the seal is good, else why not (``UNSEALED``,
        ``UNKNOWN_KEY``, ``BAD_SEAL``)."""
        if kid == UNSEALED_ID:
            return UNSEALED
        want = self.tag(kid, head, payload)
        if want is None:
            return UNKNOWN_KEY
        return None if hmac.compare_digest(want, tag) else BAD_SEAL


# ------------------------------------------------------------ key files
def parse_keys(text: str, where: str) -> list[bytes]:
    """Keys from a key file's text, in order (duplicates kept once)."""
    keys: list[bytes] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            key = bytes.fromhex(line)
        except ValueError:
            key = b""
        if len(key) != KEY_BYTES:
            raise ConfigError(where, f"line {n} is not a key of {2 * KEY_BYTES} hex digits",
                              "make the file with `kvtier auth keygen FILE`; each line holds one key")
        if key not in keys:
            keys.append(key)
    if not keys:
        raise ConfigError(where, "the key file holds no key", "make one with `kvtier auth keygen FILE`")
    return keys


def read_key_file(path: str, where: str = "auth_key_file") -> list[bytes]:
    """The keys of the file at ``path``, which must be a regular file that
    no other user can write or read (its keys let anyone forge KV). Errors
    are ConfigError naming ``where`` and the fix."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(where, f"cannot open {path}: {exc.strerror}",
                          "name a readable key file made with `kvtier auth keygen FILE`") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(where, f"{path} is not a regular file", "name the key file itself")
        problem = file_mode_problem(st)
        if problem:
            raise ConfigError(where, f"{path} {problem}", f"chmod 600 {path} (or 400, or 640 for a group of readers)")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE:
        raise ConfigError(where, f"{path} is larger than a key file ({MAX_KEY_FILE} B)", "name the key file itself")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(where, f"{path} is not a text key file", "make one with `kvtier auth keygen FILE`") from None
    return parse_keys(text, where)


def file_mode_problem(st: os.stat_result) -> str | None:
    """What is wrong with a key file's owner and mode, or None: other users
    must neither write it (they could put in their own key) nor read it
    (they could forge); its group may read it."""
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & 0o004:
        return f"is readable by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_uid not in (os.geteuid(), 0):
        return f"belongs to another user (uid {st.st_uid})"
    return None


def load_keyring(path: str, where: str = "auth_key_file") -> Keyring:
    keys = read_key_file(path, where)
    try:
        return Keyring(keys)
    except ValueError as exc:
        raise ConfigError(where, str(exc), "make a new key with `kvtier auth keygen FILE`") from None


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def format_keys(keys: Sequence[bytes]) -> str:
    lines = ["# kvtier cluster keys: the first seals new objects; every key here is accepted.",
             "# Secret: anyone who reads this file can make engines serve KV of their choice.",
             "# Key ids: " + ", ".join(key_id(k).hex() for k in keys)]
    return "\n".join(lines + [k.hex() for k in keys]) + "\n"


def write_key_file(path: str, keys: Sequence[bytes], replace: bool = False) -> None:
    """Write ``keys`` to ``path`` with mode 0600: created exclusively (an
    existing file or a link there is an error) unless ``replace``, which
    writes a new file beside it and renames it over."""
    data = format_keys(keys).encode("ascii")
    target = path + ".tmp" if replace else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(target)
        raise
    os.close(fd)
    if replace:
        os.replace(target, path)

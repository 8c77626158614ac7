"""TLS of the Redis tier, the same for both kinds of its connections:
redis-py's (lookups, stores, scripts, a cluster's slot map) and the read
path's own sockets (``readpool``).

- The server's certificate is verified against ``tls_ca_file`` (empty: the
  system store) and, unless ``tls_check_hostname`` is off, must name the host
  kvtier connects to (an address such as 127.0.0.1 must be one of its IP
  SANs).
- ``tls_cert_file`` (and ``tls_key_file``, unless the key is in the same
  file) is presented as a client certificate: a Redis with
  ``tls-auth-clients yes``, its default, accepts no connection without one.
- ``check`` loads every file once while the configuration is read, so a
  missing or unreadable file, a bad PEM or a key that does not belong to the
  certificate stops start-up naming the key; a server that then refuses the
  handshake (another CA, another name) is storage trouble like a server that
  is down: misses, logged with OpenSSL's reason.

A private key protected by a passphrase is refused: kvtier has no place for
the passphrase, and OpenSSL would otherwise ask for it on the terminal.
"""

from __future__ import annotations

import ssl
from typing import Any

from kvtier.errors import ConfigError

FILES = ("tls_ca_file", "tls_cert_file", "tls_key_file")


def _no_passphrase() -> str:
    raise ValueError("the private key is encrypted with a passphrase")


def context(cfg: Any) -> ssl.SSLContext:
    """A client context for ``cfg`` (a ``RedisConfig`` with ``tls`` on)."""
    ctx = ssl.create_default_context(cafile=cfg.tls_ca_file or None)
    ctx.check_hostname = cfg.tls_check_hostname  # the certificate is verified either way
    if cfg.tls_cert_file:
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file or None, password=_no_passphrase)
    return ctx


def client_kwargs(cfg: Any) -> dict[str, Any]:
    """redis-py's ``ssl_*`` arguments for the same settings as ``context``."""
    return {
        "ssl_ca_certs": cfg.tls_ca_file or None,
        "ssl_certfile": cfg.tls_cert_file or None,
        "ssl_keyfile": cfg.tls_key_file or None,
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": cfg.tls_check_hostname,
    }


def check(cfg: Any, prefix: str) -> None:
    """ConfigError naming the key, for TLS settings that cannot work."""
    if not cfg.tls:
        for name in FILES:
            if getattr(cfg, name):
                raise ConfigError(f"{prefix}{name}", "is set but tls is off",
                                  "set tls: true (or write the tier URL as rediss://), or drop it")
        return
    if cfg.tls_key_file and not cfg.tls_cert_file:
        raise ConfigError(f"{prefix}tls_cert_file", "is needed with tls_key_file",
                          "set tls_cert_file to the client certificate that goes with the key")
    try:
        ssl.create_default_context(cafile=cfg.tls_ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{prefix}tls_ca_file", f"cannot load {cfg.tls_ca_file} ({_reason(exc)})",
                          "give a readable PEM file of the CA certificates that sign the server's") from None
    try:
        context(cfg)
    except (OSError, ssl.SSLError, ValueError) as exc:
        key = "tls_key_file" if cfg.tls_key_file else "tls_cert_file"
        raise ConfigError(f"{prefix}{key}", f"cannot load the client certificate and key ({_reason(exc)})",
                          "give readable PEM files: the certificate in tls_cert_file, its unencrypted private key "
                          "in tls_key_file (or both in tls_cert_file)") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__

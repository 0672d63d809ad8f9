"""TLS client contexts for etcd and NATS, built from their settings, with one-line errors.

Both clients take a CA to trust (else the system's trust store) and optionally a client certificate and key
for a server that verifies its clients. A file that is missing, unreadable or not PEM is a configuration
error naming the setting and the path, raised at start-up rather than as a handshake failure later, so
``dynamo-run`` stops with one line instead of retrying a connection that can never work.
"""

from __future__ import annotations

import ssl

from .errors import RuntimeConfigError


def client_context(*, ca: str | None, cert: str | None, key: str | None, names: tuple[str, str, str],
                   insecure: bool = False) -> ssl.SSLContext:
    """A context that verifies the server against ``ca`` (else the system trust store) and presents
    ``cert``/``key`` when given; ``names`` are the settings' names for ca, cert and key, for messages.

    ``insecure`` skips verifying the server (development only; a warning is the caller's to log).
    """
    ca_name, cert_name, key_name = names
    if key and not cert:
        raise RuntimeConfigError(f"{key_name} is set without {cert_name}: a client key needs its certificate")
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except FileNotFoundError:
        raise RuntimeConfigError(f"{ca_name}={ca}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise RuntimeConfigError(f"{ca_name}={ca}: not a readable PEM CA certificate ({_reason(exc)})") from None
    if cert:
        try:
            ctx.load_cert_chain(cert, key)
        except FileNotFoundError as exc:
            raise RuntimeConfigError(f"{cert_name}={cert} / {key_name}={key}: {exc.filename or cert}: no such file") from None
        except (ssl.SSLError, OSError) as exc:
            raise RuntimeConfigError(
                f"{cert_name}={cert} / {key_name}={key}: not a matching PEM certificate and key ({_reason(exc)})") from None
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__

"""Job secret: per-rank CURVE keys and signed rendezvous entries.

Every rank of a job holds the same secret (``RRFP_JOB_SECRET``, or a file such as a
mounted Kubernetes Secret). From it each rank derives, without talking to anyone,

- every rank's CURVE key pair (HKDF-style: ``HMAC(PRK, "curve/<job>/<rank>")``), so a rank
  knows the public key of each peer it connects to and of each peer allowed to connect to
  it: nothing key-related is read from the (unauthenticated) store;
- an HMAC key that signs what a rank publishes in the torch.distributed store (its
  endpoint), so an entry overwritten by anyone without the secret is detected and refused.

ZeroMQ's CURVE (CurveZMQ, RFC 26) then encrypts and authenticates every frame of every
connection; its per-message nonces make a frame replayed onto the same or another
connection fail to decrypt. A message's step is inside the authenticated frames, so an
authenticated peer replaying an earlier step's message is refused by the runtime as stale
or duplicate.

The torch data plane (gloo/NCCL process groups) cannot be CURVE-protected: its integrity
rests on the authenticated announcements sent over this control plane (sizes included)
and on the process group's own rendezvous.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading

import zmq
from zmq.utils import z85

from .._secret import normalized, read_secret_file

__all__ = ["ENV_SECRET", "ForgedEntry", "JobAuth", "configure", "current"]

ENV_SECRET = "RRFP_JOB_SECRET"
"""Environment variable holding the job secret (any text; at least 16 bytes)."""
_SALT = b"rrfp-job-secret-v1"


class ForgedEntry(ValueError):
    """A store entry whose signature does not match the job secret."""


class JobAuth:
    """Keys derived from one job secret.

    Args:
        secret: the job secret, at least 16 bytes (str is UTF-8 encoded; surrounding
            whitespace, e.g. a file's trailing newline, is stripped).

    Raises:
        ValueError: a secret shorter than 16 bytes.
    """

    def __init__(self, secret: bytes | str) -> None:
        raw = normalized(secret)
        # HKDF extract: the PRK is the only thing kept; expansion is one HMAC per label.
        self._prk = hmac.new(_SALT, raw, hashlib.sha256).digest()
        self._pairs: dict[tuple[str, int], tuple[bytes, bytes]] = {}

    @staticmethod
    def generate() -> str:
        """A fresh random secret (64 hex characters, 256 bits)."""
        return secrets.token_hex(32)

    @classmethod
    def from_env(cls, environ: dict | None = None) -> JobAuth | None:
        """From ``RRFP_JOB_SECRET``; None when unset or empty."""
        value = (os.environ if environ is None else environ).get(ENV_SECRET, "")
        return cls(value) if value else None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> JobAuth:
        """From a file's content (e.g. a mounted Kubernetes Secret).

        Raises:
            ValueError: one line naming the file when it cannot be read or is too short.
        """
        return cls(read_secret_file(path))

    def _derive(self, label: str) -> bytes:
        return hmac.new(self._prk, label.encode(), hashlib.sha256).digest()

    def curve_keypair(self, job: str, rank: int) -> tuple[bytes, bytes]:
        """``(public, secret)`` Z85-encoded CURVE keys of ``rank`` in ``job``."""
        pair = self._pairs.get((job, rank))
        if pair is None:
            sec = z85.encode(self._derive(f"curve/{job}/{rank}"))
            pair = self._pairs[(job, rank)] = (zmq.curve_public(sec), sec)
        return pair

    def sign(self, job: str, name: str, value: str) -> str:
        """``value`` followed by a tab and the hex HMAC over job, entry name and value."""
        if "\t" in value:
            raise ValueError(f"store value for {name!r} contains a tab")
        return f"{value}\t{self._mac(job, name, value)}"

    def verify(self, job: str, name: str, signed: bytes | str) -> str:
        """The value of a :meth:`sign`-ed entry.

        Raises:
            ForgedEntry: the entry is unsigned or signed with another secret, job or name.
        """
        text = signed.decode("utf-8", "replace") if isinstance(signed, bytes) else signed
        value, _, mac = text.rpartition("\t")
        if not value or not hmac.compare_digest(mac, self._mac(job, name, value)):
            raise ForgedEntry(f"store entry {name!r} is not signed with this job's secret")
        return value

    def _mac(self, job: str, name: str, value: str) -> str:
        return hmac.new(self._derive("store"), f"{job}\0{name}\0{value}".encode(), hashlib.sha256).hexdigest()


# Process-wide choice, set once by the entry point (``rrfp train`` flags) and read by
# every ZmqTransport built without explicit arguments (Pipeline's default transport).
_lock = threading.Lock()
_configured: tuple[JobAuth | None, bool] | None = None


def configure(auth: JobAuth | None, insecure: bool = False) -> None:
    """Set this process's job secret and whether a non-loopback bind without one is allowed."""
    global _configured
    with _lock:
        _configured = (auth, insecure)


def current() -> tuple[JobAuth | None, bool]:
    """``(auth, insecure)``: what :func:`configure` set, else ``RRFP_JOB_SECRET`` and
    ``RRFP_INSECURE=1`` from the environment.

    Raises:
        ValueError: a secret in the environment shorter than 16 bytes.
    """
    with _lock:
        if _configured is not None:
            return _configured
    return JobAuth.from_env(), os.environ.get("RRFP_INSECURE", "") == "1"

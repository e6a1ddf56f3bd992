"""How the client reaches the master: the channel (its credentials and
options), each call's deadline, and retries under a bounded budget.

Every call has a deadline. Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED)
are retried with exponential backoff and jitter within a bounded budget of
attempts and time, each retry logged as one warning (the call, the master's
address, the attempt), then end in `Unavailable` saying what was tried. Every
other failure is raised at once as the domain error of its status code
(`dlfleet.api.status`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import grpc

from dlfleet.api.client.loop import _IoLoop
from dlfleet.api.env import TLS_CA_ENV
from dlfleet.api.errors import InvalidArgument, Unavailable
from dlfleet.api.status import TOKEN_METADATA_KEY, error_from_status

# One logger for the whole client, under the name operators filter on.
_log = logging.getLogger("dlfleet.api.client")

_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# A session stream also breaks with INTERNAL: a write on a call whose
# transport went down with the master fails inside the client ("Internal
# error from Core") before the read sees UNAVAILABLE. The master never closes
# a session with INTERNAL (it refuses one with the domain error's status).
_SESSION_BREAKS = _RETRYABLE | {grpc.StatusCode.INTERNAL}
MAX_DETAILS_LOGGED = 200  # characters of a failed call's details in a retry's log line

Resp = TypeVar("Resp")


def channel_credentials(tls_ca: bytes | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel to the master: from `tls_ca`, or the PEM
    file named by $DLFLEET_TLS_CA; None (plaintext) when neither is given."""
    if tls_ca is None:
        path = os.environ.get(TLS_CA_ENV)
        if not path:
            return None
        try:
            with open(path, "rb") as pem:
                tls_ca = pem.read()
        except OSError as exc:
            raise InvalidArgument(f"${TLS_CA_ENV}: cannot read {path}: {exc.strerror}") from None
    return grpc.ssl_channel_credentials(root_certificates=tls_ca)


@dataclass(frozen=True)
class RetryPolicy:
    """By default a call rides out a master that restarts (about 30 s of
    retries); callers that must answer quickly pass a shorter policy."""

    attempts: int = 40
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    total_budget_s: float = 30.0

    def backoff(self, attempt: int) -> float:
        """Full jitter over an exponential cap."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * 2**attempt)
        return random.uniform(0, cap)


class Connection:
    """A channel to the master with its token, deadline and retry policy:
    what every call, stream and session of a client goes through."""

    def __init__(
        self,
        target: str,
        *,
        token: str,
        timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        channel: grpc.Channel | None = None,
        tls_ca: bytes | None = None,
        own_connection: bool = False,
    ) -> None:
        """`tls_ca`: PEM root certificate(s) to verify a TLS master with; when
        None, the file named by $DLFLEET_TLS_CA if set, else plaintext.
        `own_connection`: this client gets a TCP connection of its own even
        beside other clients of the same process (gRPC shares one by default),
        as the one agent of a real node has: what the fleet simulator needs to
        look like a fleet."""
        self.target = target
        self._credentials = channel_credentials(tls_ca)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._options: list[tuple[str, Any]] = [
            ("grpc.enable_retries", 0),
            # Notice a dead master or a cut link on long-lived streams.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # A master that restarts is back in about a second: reconnect
            # within 0.1-1 s of it, not after gRPC's default 1-120 s back-off
            # (every call fails fast while the channel waits to reconnect).
            ("grpc.initial_reconnect_backoff_ms", 100),
            # gRPC also takes this as the least time a connection attempt
            # gets (its handshake up to the SETTINGS frame): 100 ms would fail
            # every attempt to a master busy with thousands of nodes joining.
            # A master that is down refuses at once, whatever this is.
            ("grpc.min_reconnect_backoff_ms", 5000),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if own_connection:
            self._options.append(("grpc.use_local_subchannel_pool", 1))
        if channel is not None:
            self._channel = channel
        elif self._credentials is not None:
            self._channel = grpc.secure_channel(target, self._credentials, options=self._options)
        else:
            self._channel = grpc.insecure_channel(target, options=self._options)
        self._io_loop: _IoLoop | None = None
        self._io_lock = threading.Lock()
        self._open_stubs()

    def _open_stubs(self) -> None:
        """Make the stubs of the services a subclass calls, on `_channel`."""

    def close(self) -> None:
        self._channel.close()
        with self._io_lock:
            io, self._io_loop = self._io_loop, None
        if io is not None:
            io.close()

    def _io(self) -> _IoLoop:
        with self._io_lock:
            if self._io_loop is None:
                self._io_loop = _IoLoop(self.target, self._options, self._credentials)
            return self._io_loop

    @property
    def io_loop(self) -> asyncio.AbstractEventLoop:
        """The loop this client's sessions and `*_async` calls run on (its
        asyncio channel is opened here: call it first from outside that loop)."""
        return self._io().loop

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _await_with_retries(
        self, name: str, attempt_once: Callable[[], Awaitable[Resp]]
    ) -> Resp:
        """`_with_retries` for a call awaited on the loop."""
        attempts = _Attempts(name, self.target, self.retry)
        while True:
            try:
                return await attempt_once()
            except grpc.RpcError as error:
                pause = attempts.failed(error)
            await asyncio.sleep(pause)

    def _call(self, name: str, method: Callable[..., Resp], request: Any) -> Resp:
        def once() -> Resp:
            return method(request, timeout=self.timeout_s, metadata=self._metadata)

        return self._with_retries(name, once)

    def _with_retries(self, name: str, attempt_once: Callable[[], Resp]) -> Resp:
        """Run `attempt_once` until it succeeds, a non-transient error ends it,
        or the retry budget is spent (then `Unavailable`, naming the cause)."""
        attempts = _Attempts(name, self.target, self.retry)
        while True:
            try:
                return attempt_once()
            except grpc.RpcError as error:
                pause = attempts.failed(error)
            time.sleep(pause)


class _Attempts:
    """One call's attempts under a `RetryPolicy`: after each failure, how long
    to wait before the next, or the error that ends the call."""

    def __init__(self, name: str, target: str, policy: RetryPolicy) -> None:
        self._name = name
        self._target = target
        self._policy = policy
        self._started = time.monotonic()
        self._done = 0

    def failed(self, error: grpc.RpcError) -> float:
        code = error.code()
        if code not in _RETRYABLE:
            raise error_from_status(code, error.details() or "") from None
        policy = self._policy
        pause = policy.backoff(self._done)
        self._done += 1
        elapsed = time.monotonic() - self._started
        if self._done >= policy.attempts or elapsed + pause > policy.total_budget_s:
            raise Unavailable(
                f"{self._name} to master {self._target} failed after {self._done} attempts "
                f"over {elapsed:.1f}s: {code.name}: {error.details()}"
            ) from None
        # One line per retry, so that a master that is down or unreachable is
        # seen at once and by its address, not only when the budget is spent.
        _log.warning(
            "%s to master %s: attempt %d of %d failed (%s: %s); retrying in %.2fs",
            self._name, self._target, self._done, policy.attempts, code.name,
            _one_line(error.details()), pause,
        )  # fmt: skip
        return pause


def _one_line(details: str | None, limit: int = MAX_DETAILS_LOGGED) -> str:
    text = " ".join((details or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."

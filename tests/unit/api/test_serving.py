"""`dlfleet.api.serving` on a real thread-pool gRPC server on 127.0.0.1:0:
the token check, the request guard and the error answers every dlfleet
server shares, and the token/TLS flags of `dlmaster` and `dlbrain`."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from dlfleet.api.errors import NotFound
from dlfleet.api.serving.answers import answer, answer_stream
from dlfleet.api.serving.flags import TokenFlags, add_tls_flags, tls_from_flags
from dlfleet.api.serving.guard import RequestGuard
from dlfleet.api.serving.tokens import TokenCheck
from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.api.v1 import job_pb2

ECHO = "/test.Echo/Echo"
MISSING = "/test.Echo/Missing"
COUNT = "/test.Echo/Count"


class Echo:
    @answer
    def echo(self, request: job_pb2.JobStatus, context: Any) -> job_pb2.JobStatus:
        return request

    @answer
    def missing(self, request: job_pb2.JobStatus, context: Any) -> job_pb2.JobStatus:
        raise NotFound("x" * 5_000)

    @answer_stream
    def count(self, request: job_pb2.JobStatus, context: Any) -> Iterator[job_pb2.JobStatus]:
        """Two answers, then a domain error: the stream ends with its status."""
        for i in range(2):
            yield job_pb2.JobStatus(job_name=f"{request.job_name}{i}")
        raise NotFound("no third")


@pytest.fixture
def channel() -> Iterator[grpc.Channel]:
    echo = Echo()

    def unary(call: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(
            call, job_pb2.JobStatus.FromString, job_pb2.JobStatus.SerializeToString
        )

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        interceptors=[TokenCheck("secret", "missing or wrong token"), RequestGuard()],
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Echo",
                {
                    "Echo": unary(echo.echo),
                    "Missing": unary(echo.missing),
                    "Count": grpc.unary_stream_rpc_method_handler(
                        echo.count,
                        job_pb2.JobStatus.FromString,
                        job_pb2.JobStatus.SerializeToString,
                    ),
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as opened:
        yield opened
    server.stop(0)


def call(channel: grpc.Channel, method: str, raw: bytes, token: str | None) -> bytes:
    metadata = ((TOKEN_METADATA_KEY, token),) if token is not None else ()
    stub: Any = channel.unary_unary(method)
    result: bytes = stub(raw, metadata=metadata, timeout=10)
    return result


def test_a_call_with_the_token_is_answered_and_one_without_is_refused_in_the_servers_words(
    channel: grpc.Channel,
) -> None:
    request = job_pb2.JobStatus(job_name="j").SerializeToString()
    assert call(channel, ECHO, request, "secret") == request
    for token in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as refused:
            call(channel, ECHO, request, token)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert refused.value.details() == "missing or wrong token"


def test_a_request_that_does_not_parse_is_invalid_argument(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call(channel, ECHO, b"\xff\xff\xff", "secret")
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("malformed request")


def test_a_domain_error_is_answered_with_its_code_and_bounded_details(
    channel: grpc.Channel,
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call(channel, MISSING, b"", "secret")
    assert refused.value.code() is grpc.StatusCode.NOT_FOUND
    assert (refused.value.details() or "").endswith("... (5000 bytes in all)")


def test_a_domain_error_raised_while_a_stream_yields_ends_it_with_its_code(
    channel: grpc.Channel,
) -> None:
    stub: Any = channel.unary_stream(
        COUNT,
        request_serializer=job_pb2.JobStatus.SerializeToString,
        response_deserializer=job_pb2.JobStatus.FromString,
    )
    got: list[str] = []
    with pytest.raises(grpc.RpcError) as refused:
        for answer_ in stub(
            job_pb2.JobStatus(job_name="n"), metadata=((TOKEN_METADATA_KEY, "secret"),), timeout=10
        ):
            got.append(answer_.job_name)
    assert got == ["n0", "n1"]
    assert refused.value.code() is grpc.StatusCode.NOT_FOUND
    assert refused.value.details() == "no third"


def test_a_streaming_method_without_the_token_gets_a_streaming_denial() -> None:
    streams: grpc.RpcMethodHandler[Any, Any] = grpc.stream_stream_rpc_method_handler(
        lambda requests, context: requests
    )

    class Details:
        method = "/test.Echo/Streams"
        invocation_metadata = ((TOKEN_METADATA_KEY, "wrong"),)

    denied = TokenCheck("secret").intercept_service(lambda details: streams, Details())  # type: ignore[arg-type]
    assert denied is not None and denied.request_streaming and denied.response_streaming


def parse(flags: TokenFlags, argv: list[str]) -> tuple[str, tuple[bytes, bytes] | None]:
    parser = argparse.ArgumentParser()
    flags.add_to(parser)
    add_tls_flags(parser)
    args = parser.parse_args(argv)
    return flags.token(args, parser), tls_from_flags(args, parser)


def test_token_flags_keep_each_programs_words_and_precedence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TEST_TOKEN", raising=False)
    (tmp_path / "token").write_text("from-file\n")
    master = TokenFlags(env="TEST_TOKEN")
    brain = TokenFlags(env="TEST_TOKEN", noun="token", both_refused=True)
    both = ["--token", "t", "--token-file", str(tmp_path / "token")]
    assert parse(master, both) == ("from-file", None)
    for flags, argv, words in (
        (master, [], "no job token: pass --token-file, --token, or set $TEST_TOKEN"),
        (brain, [], "no token: pass --token-file, --token, or set $TEST_TOKEN"),
        (brain, both, "pass --token or --token-file, not both"),
        (master, ["--token", "t", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    ):
        with pytest.raises(SystemExit) as exited:
            parse(flags, argv)
        assert exited.value.code == 2 and words in capsys.readouterr().err


def test_a_tls_file_that_is_not_pem_is_a_usage_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "c.pem").write_text("not a certificate")
    (tmp_path / "k.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    argv = [
        "--token",
        "t",
        "--tls-cert",
        str(tmp_path / "c.pem"),
        "--tls-key",
        str(tmp_path / "k.pem"),
    ]
    with pytest.raises(SystemExit):
        parse(TokenFlags(env="TEST_TOKEN"), argv)
    assert f"TLS certificate {tmp_path / 'c.pem'}: not a PEM certificate" in capsys.readouterr().err

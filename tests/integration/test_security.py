"""The public API's security through real processes on loopback: mutual TLS, API keys, tenant isolation of
the prefix cache (the side channel of vLLM's CVE-2025-46570), the public limits, and the startup checks
(sidecars refuse a reachable address, a malformed keys file stops the frontend). A refused handshake is checked
as one (tls_testing.py), never as any OSError: an HTTP error answer is an OSError too.

One pod serves the module: `pagedserve serve` with mutual TLS, two tenants and tight limits; the test of the
behaviour without a keys file starts one of its own."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import free_port
from stack_testing import Pod
from tls_testing import (
    CLIENT_REFUSED,
    SERVER_CLOSED,
    Certs,
    grpc_handshake_refusal,
    https_handshake_refusal,
    make_certs,
)

from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.protos import kv_events_pb2
from pagedserve.services.common.processes import running_service, start_service, stop_service

KEY_A, KEY_A_ROTATED, KEY_B = "alpha-key-0123456789abcdef", "alpha-key-rotated-0123456789", "beta-key-0123456789abcdef"
KEYS_FILE = f"# test tenants\n{KEY_A} alpha\n{KEY_A_ROTATED} alpha\n{KEY_B} beta\n"
A, B = [("authorization", f"Bearer {KEY_A}")], [("x-api-key", KEY_B)]
LONG_PROMPT = "In the beginning the servers trusted every caller, and every cached prefix was shared. " * 6
MAX_MESSAGE_BYTES = 64 * 1024
ENV = dict(os.environ)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(KEYS_FILE)
    return path


@pytest.fixture(scope="module")
def pod(tiny_chat_model_dir: Path, certs: Certs, keys_file: Path) -> Iterator[Pod]:
    http_port = free_port()
    pod = Pod(tiny_chat_model_dir, "--num-blocks", "256", "--http-port", str(http_port), "--tls-cert",
              str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca),
              "--api-keys-file", str(keys_file),
              "--max-prompt-tokens", "200", "--max-new-tokens", "400", "--max-n", "2", "--max-streams-per-tenant", "1",
              "--max-message-bytes", str(MAX_MESSAGE_BYTES), credentials=certs.client(), metadata=A)
    pod.https = f"https://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    yield pod
    output = pod.stop()
    assert pod.proc.returncode == 0, output
    # the supervisor watched the frontend through its own socket: no certificate, no key, and no failure
    assert '"status": "running' in output and "status unavailable" not in output, output


def code_of(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()  # type: ignore[no-any-return]


def complete(pod: Pod, metadata: list[tuple[str, str]], text: str = "Hello", **params: Any) -> pb.CompleteResponse:
    request = pb.GenerateRequest(text=text, params=pb.GenerationParameters(**params))
    return pod.stub.Complete(request, timeout=60, metadata=metadata)


def first_and_cancel(stream: Any) -> Any:
    """The first message of an endless stream (the snapshot of SubscribeKvEvents), then the stream cancelled."""
    try:
        return next(stream)
    finally:
        stream.cancel()


def calls_of_every_method(stub: pb_grpc.InferenceStub, metadata: list[tuple[str, str]]) -> dict[str, Callable[[], Any]]:
    generate = pb.GenerateRequest(text="Hello", params=pb.GenerationParameters(max_tokens=2))
    calls = {
        "Generate": lambda: list(stub.Generate(generate, timeout=30, metadata=metadata)),
        "Complete": lambda: stub.Complete(generate, timeout=30, metadata=metadata),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="Hello"), timeout=30, metadata=metadata),
        "ListModels": lambda: stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=metadata),
        "Status": lambda: stub.Status(pb.StatusRequest(), timeout=30, metadata=metadata),
        "SubscribeKvEvents": lambda: first_and_cancel(stub.SubscribeKvEvents(
            kv_events_pb2.SubscribeKvEventsRequest(), timeout=30, metadata=metadata)),
    }
    assert set(calls) == set(pb.DESCRIPTOR.services_by_name["Inference"].methods_by_name)  # none forgotten
    return calls


# ---- TLS ------------------------------------------------------------------------------------------------


def test_mutual_tls_round_trip_and_clients_without_a_trusted_certificate_are_refused(
    pod: Pod, certs: Certs
) -> None:
    chunks, texts = pod.generate("The capital of France is", max_tokens=6, ignore_eos=True)
    assert chunks[-1].usage.completion_tokens == 6 and texts[0]
    # the server ends the handshake: no client certificate, one from a CA it does not trust, or no TLS at all
    for refused in (grpc.secure_channel(pod.address, certs.client(with_cert=False)),
                    grpc.secure_channel(pod.address, certs.stranger()), grpc.insecure_channel(pod.address)):
        with refused:
            grpc_handshake_refusal(refused, SERVER_CLOSED)
    # the client ends it: the server's certificate is not from the CA it was told to trust
    untrusting = grpc.ssl_channel_credentials(certs.stranger_cert.read_bytes(), certs.client_key.read_bytes(),
                                              certs.client_cert.read_bytes())
    with grpc.secure_channel(pod.address, untrusting) as refused:
        grpc_handshake_refusal(refused, CLIENT_REFUSED)
    health = health_pb2_grpc.HealthStub(pod.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # meanwhile, a trusted client is answered


def test_the_http_api_speaks_mutual_tls_with_the_same_certificates_and_keys(pod: Pod, certs: Certs) -> None:
    def get(context: ssl.SSLContext, key: str = KEY_A) -> Any:
        request = urllib.request.Request(f"{pod.https}/v1/models", headers={"authorization": f"Bearer {key}"})  # type: ignore[attr-defined]
        return urllib.request.urlopen(request, context=context, timeout=30)

    trusted = ssl.create_default_context(cafile=certs.ca)
    trusted.load_cert_chain(certs.client_cert, certs.client_key)
    with get(trusted) as response:
        assert response.status == 200 and json.loads(response.read())["data"]
    with pytest.raises(urllib.error.HTTPError) as info:
        get(trusted, "not-a-key-0123456789")
    assert info.value.code == 401
    without_cert = ssl.create_default_context(cafile=certs.ca)
    stranger = ssl.create_default_context(cafile=certs.ca)
    stranger.load_cert_chain(certs.stranger_cert, certs.stranger_key)
    for refused in (without_cert, stranger):  # the server closes the connection: no HTTP answer, not even a 401
        https_handshake_refusal(lambda context=refused: get(context).read())
    untrusting = ssl.create_default_context()  # the system's roots: the test CA is not among them
    untrusting.load_cert_chain(certs.client_cert, certs.client_key)
    assert isinstance(https_handshake_refusal(lambda: get(untrusting)), ssl.SSLCertVerificationError)
    plain = f"{pod.https.replace('https', 'http', 1)}/health"  # type: ignore[attr-defined]
    https_handshake_refusal(lambda: urllib.request.urlopen(plain, timeout=30).read())  # no plain HTTP beside HTTPS


# ---- API keys -------------------------------------------------------------------------------------------


def test_every_inference_method_needs_a_valid_key_and_probes_do_not(pod: Pod) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for metadata in ([], [("authorization", "Bearer not-a-key-0123456789")], [("x-api-key", KEY_A[:-1])],
                     [("authorization", KEY_A[:-1] + "x")]):
        for name, call in calls_of_every_method(pod.stub, metadata).items():
            assert code_of(call) == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
    for metadata in (A, B, [("x-api-key", KEY_A_ROTATED)]):
        for call in calls_of_every_method(pod.stub, metadata).values():
            call()
    health = health_pb2_grpc.HealthStub(pod.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(reflection_pb2_grpc.ServerReflectionStub(pod.channel).ServerReflectionInfo(iter([request])))
    assert "pagedserve.inference.v1.Inference" in {s.name for s in reply.list_services_response.service}


def test_tenant_b_gets_no_hit_on_tenant_a_s_prompt(pod: Pod) -> None:
    """CVE-2025-46570: a shared prefix cache lets one tenant learn, from the time to first token, whether
    another sent a prompt. Here the namespace is the authenticated tenant's, so B's copy of A's prompt
    misses; the cached-token count shows it without timing (too noisy on a shared machine)."""
    def cached(metadata: list[tuple[str, str]]) -> int:
        return complete(pod, metadata, LONG_PROMPT, max_tokens=2).usage.cached_prompt_tokens  # type: ignore[no-any-return]

    # max_tokens=2: a request that ends at its prefill step (max_tokens=1) leaves no prompt blocks cached today
    first = complete(pod, A, LONG_PROMPT, max_tokens=2).usage
    assert first.cached_prompt_tokens == 0 and first.prompt_tokens > 64
    assert cached(A) > 0  # within one tenant the hit is there
    assert cached([("x-api-key", KEY_A_ROTATED)]) > 0  # the tenant owns the cache, not the key
    assert cached(B) == 0  # another tenant's identical prompt misses
    # a client salt narrows sharing inside its own tenant, and never reaches another tenant's namespace
    salted = [*A, ("x-cache-salt", "team-1")]
    assert cached(salted) == 0 and cached(salted) > 0
    assert cached([*B, ("x-cache-salt", "team-1")]) == 0
    pod.wait_idle()


def test_without_a_keys_file_keyless_callers_share_one_tenant_and_its_cache(tiny_chat_model_dir: Path) -> None:
    """Pinned, so that changing it is a decision (docs/reliability.md): with no keys file every caller is trusted,
    and a key is taken at its word as a tenant label. Callers that send no key are one tenant: one's prompt is a
    prefix hit for another, through either door. A caller that sends another's key is that tenant too."""
    http_port = free_port()
    keyless = Pod(tiny_chat_model_dir, "--num-blocks", "256", "--http-port", str(http_port))
    try:
        def grpc_cached(*metadata: tuple[str, str]) -> int:
            with grpc.insecure_channel(keyless.address) as channel:  # a caller of its own: its own connection
                request = pb.GenerateRequest(text=LONG_PROMPT, params=pb.GenerationParameters(max_tokens=2))
                reply = pb_grpc.InferenceStub(channel).Complete(request, timeout=60, metadata=metadata)
            return reply.usage.cached_prompt_tokens  # type: ignore[no-any-return]

        def http_cached(headers: dict[str, str]) -> int:
            body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 2}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                             {"content-type": "application/json", **headers})
            with urllib.request.urlopen(request, timeout=60) as reply:
                return json.loads(reply.read())["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[no-any-return]

        assert grpc_cached() == 0  # cold
        assert grpc_cached() > 0  # another keyless caller hits the first one's prompt
        assert grpc_cached(("x-api-key", "any-label-0123456789")) == 0  # a label is a namespace of its own
        assert grpc_cached(("authorization", "Bearer any-label-0123456789")) > 0  # whoever sends it shares it
        assert http_cached({}) > 0  # and through the other door
        assert http_cached({"x-cache-salt": "team-1"}) == 0  # a client's salt still splits the namespace it is in
    finally:
        output = keyless.stop()
    assert keyless.proc.returncode == 0, output


# ---- limits ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "text", "message"), [
    ({"max_tokens": 401}, "Hello", "max_tokens: 401 exceeds this server's limit of 400"),
    ({"n": 3, "temperature": 1.0}, "Hello", "n: must be in [1, 2]"),
    ({"max_tokens": 1}, "word " * 300, "this server's limit of 200"),
])
def test_request_limits_are_invalid_argument(pod: Pod, params: dict[str, Any], text: str, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        complete(pod, A, text, **params)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (info.value.details() or "")
    complete(pod, A, max_tokens=1)  # the refused request released its stream


def test_a_message_over_the_limit_is_resource_exhausted(pod: Pod) -> None:
    assert code_of(lambda: complete(pod, A, "x" * MAX_MESSAGE_BYTES, max_tokens=1)) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    # a quarter of the size gets through to the prompt check (its tokens exceed --max-prompt-tokens)
    assert code_of(lambda: complete(pod, A, "x" * (MAX_MESSAGE_BYTES // 4), max_tokens=1)) == \
        grpc.StatusCode.INVALID_ARGUMENT


def test_streams_per_tenant_are_limited_and_released_on_cancel(pod: Pod) -> None:
    request = pb.GenerateRequest(text="Count to a thousand:", params=pb.GenerationParameters(
        max_tokens=400, ignore_eos=True))
    held = pod.stub.Generate(request, metadata=A)
    next(held)  # A's only stream is running
    with pytest.raises(grpc.RpcError) as info:
        complete(pod, [("x-api-key", KEY_A_ROTATED)], max_tokens=1)  # the same tenant through its other key
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit per tenant" in (info.value.details() or "")
    assert complete(pod, B, max_tokens=1).usage.completion_tokens == 1  # B has its own count
    assert held.cancel()  # still running: cancelled, not finished
    pod.wait_idle()  # the handler released the stream before the engine saw the abort
    assert complete(pod, A, max_tokens=1).usage.completion_tokens == 1


# ---- the clients --------------------------------------------------------------------------------------


def test_client_commands_with_tls_and_a_key(pod: Pod, certs: Certs) -> None:
    cli = [sys.executable, "-m", "pagedserve"]
    tls = ["--address", pod.address, "--tls-ca", str(certs.ca), "--tls-cert", str(certs.client_cert), "--tls-key",
           str(certs.client_key)]
    status = subprocess.run([*cli, "status", *tls, "--json"], capture_output=True, text=True, timeout=60,
                            env={**ENV, "PAGEDSERVE_API_KEY": KEY_B})
    assert status.returncode == 0 and '"num_total_blocks": 256' in status.stdout, status.stderr
    out = subprocess.run([*cli, "generate", *tls, "--api-key", KEY_A, "--max-tokens", "4", "Hello"],
                         capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0 and out.stdout.strip() == pod.generate("Hello", max_tokens=4)[1][0].strip()
    keyless = subprocess.run([*cli, "status", *tls], capture_output=True, text=True, timeout=60, env=ENV)
    assert keyless.returncode == 1 and "UNAUTHENTICATED" in keyless.stderr


# ---- the frontend alone: TLS without client certificates, the local socket -------------------------------


def test_frontend_tls_without_client_ca_and_its_local_socket(tmp_path: Path, certs: Certs, keys_file: Path) -> None:
    """No sidecars: the frontend listens (health NOT_SERVING, calls UNAVAILABLE) while it waits for them,
    which is enough to see the handshake and the order of checks (a key before readiness)."""
    local = f"unix:{tmp_path}/frontend.sock"
    absent = f"unix:{tmp_path}/absent.sock"
    frontend = start_service(["frontend", "--block-manager", absent, "--executor", absent, "--sidecar-timeout", "600",
                              "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                              "--api-keys-file", str(keys_file), "--local-listen", local], until_serving=False)
    try:
        with grpc.secure_channel(frontend.address, certs.client(with_cert=False)) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # TLS without a client certificate
            stub = pb_grpc.InferenceStub(channel)
            assert code_of(lambda: stub.Status(pb.StatusRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: stub.Status(pb.StatusRequest(), timeout=10, metadata=A)) == \
                grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(local) as channel:  # the supervisor's socket: no TLS, Status without a key
            stub = pb_grpc.InferenceStub(channel)
            assert code_of(lambda: stub.Status(pb.StatusRequest(), timeout=10)) == grpc.StatusCode.UNAVAILABLE
            generate = pb.GenerateRequest(text="Hello")
            assert code_of(lambda: list(stub.Generate(generate, timeout=10))) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: stub.Complete(generate, timeout=10, metadata=B)) == grpc.StatusCode.UNAVAILABLE
    finally:  # it waits for its sidecars and reads SIGTERM only after that wait: no grace to give
        stop_service(frontend, grace=0.5)


# ---- startup checks -------------------------------------------------------------------------------------


def run_pagedserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True, timeout=120,
                          env=ENV)


@pytest.mark.parametrize("command", [["block-manager", "--num-blocks", "8"], ["executor"]])
@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0"])
def test_sidecars_refuse_a_reachable_address(command: list[str], listen: str) -> None:
    done = run_pagedserve(*command, "--listen", listen)
    assert done.returncode != 0 and "authenticates no one" in done.stderr and "--allow-remote" in done.stderr, done


def test_a_sidecar_listens_beyond_loopback_when_allowed() -> None:
    with running_service(["block-manager", "--num-blocks", "8", "--allow-remote"], listen="0.0.0.0:0") as service:
        assert service.proc.poll() is None  # SERVING, checked through 127.0.0.1


def test_a_malformed_keys_file_stops_the_frontend_and_serve(tmp_path: Path) -> None:
    bad = tmp_path / "keys"
    bad.write_text(f"{KEY_A} alpha\n{KEY_B}\n")
    frontend = run_pagedserve("frontend", "--block-manager", "unix:/absent", "--executor", "unix:/absent",
                              "--api-keys-file", str(bad))
    assert frontend.returncode != 0 and f"--api-keys-file {bad}, line 2: expected `KEY TENANT`" in frontend.stderr
    assert KEY_B not in frontend.stderr
    serve = run_pagedserve("serve", "--api-keys-file", str(bad), "--model", "/absent")  # before any model loads
    assert serve.returncode != 0 and "line 2: expected `KEY TENANT`" in serve.stderr, serve.stderr
    local = run_pagedserve("frontend", "--block-manager", "unix:/absent", "--executor", "unix:/absent",
                           "--local-listen", "127.0.0.1:0")
    assert local.returncode != 0 and "must be unix:PATH" in local.stderr

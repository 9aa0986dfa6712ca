"""The security pieces without a server: the keys file, the tenant's cache salt, the public limits, the
sidecars' listen check and the TLS flags (tests/integration/test_security.py runs them in real processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.services.common.addresses import check_sidecar_listen, is_local_address
from pagedserve.services.common.cache_salt import client_salt, tenant_salt
from pagedserve.services.common.errors import InvalidRequest, OutOfCapacity
from pagedserve.services.common.tls import TlsConfigError, server_credentials
from pagedserve.services.frontend.auth import ApiKeys, KeysFileError, presented_key
from pagedserve.services.frontend.limits import ApiLimits, StreamCounter
from pagedserve.services.frontend.request import GenerationParams

KEY_A, KEY_A2, KEY_B = "a" * 16 + "-first", "a" * 16 + "-rotated", "b" * 24


def test_keys_file_maps_keys_to_tenants() -> None:
    keys = ApiKeys.parse(f"# tenants\n\n{KEY_A} alpha\n  {KEY_A2}   alpha  \n{KEY_B} beta\n")
    assert keys.tenants == {"alpha", "beta"}
    assert keys.tenant_for(KEY_A) == keys.tenant_for(KEY_A2) == "alpha" and keys.tenant_for(KEY_B) == "beta"
    assert keys.tenant_for("") is None and keys.tenant_for(KEY_A[:-1]) is None and keys.tenant_for(KEY_A + "x") is None


@pytest.mark.parametrize(("text", "message"), [
    (f"{KEY_A}\n", "line 1: expected `KEY TENANT`, found 1 fields"),
    (f"# c\n{KEY_A} alpha extra\n", "line 2: expected `KEY TENANT`, found 3 fields"),
    ("short alpha\n", "line 1: a key must be at least 16 printable ASCII characters"),
    (f"{'é' * 16} alpha\n", "line 1: a key must be at least 16"),
    (f"{KEY_A} alpha\n{KEY_A} beta\n", "line 2: the same key as line 1"),
    ("# nothing\n\n", "no keys (every call would be refused)"),
])
def test_a_malformed_keys_file_is_refused_naming_the_line_not_the_key(text: str, message: str) -> None:
    with pytest.raises(KeysFileError, match="keys file") as error:
        ApiKeys.parse(text, "the keys file")
    assert message in str(error.value) and KEY_A not in str(error.value)


def test_keys_file_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match=r"--api-keys-file .*missing: cannot read it"):
        ApiKeys.load(str(tmp_path / "missing"))


def test_presented_key_and_client_salt() -> None:
    assert presented_key([("authorization", f"Bearer {KEY_A}")]) == KEY_A
    assert presented_key([("authorization", f"bearer  {KEY_A} ")]) == KEY_A
    assert presented_key([("x-api-key", KEY_B)]) == KEY_B
    assert presented_key([("x-api-key", KEY_B), ("authorization", f"Bearer {KEY_A}")]) == KEY_A  # bearer first
    assert presented_key([("traceparent", "00-x")]) == "" and presented_key(None) == ""
    assert client_salt([("x-cache-salt", "team-1")]) == "team-1" and client_salt([]) == ""


def test_tenant_salt_separates_tenants_and_narrows_within_one() -> None:
    secret = b"s" * 32
    alpha, beta = tenant_salt(secret, "alpha", ""), tenant_salt(secret, "beta", "")
    assert alpha == tenant_salt(secret, "alpha", "") and alpha != beta
    assert tenant_salt(secret, "alpha", "team-1") not in (alpha, beta, tenant_salt(secret, "alpha", "team-2"))
    # a client salt cannot spell another tenant's namespace: the tenant's length is part of the input
    assert tenant_salt(secret, "ab", "") != tenant_salt(secret, "a", "b")
    assert tenant_salt(secret, "", "") == b"" and tenant_salt(b"t" * 32, "alpha", "") != alpha


def test_frontends_given_one_secret_file_compute_one_salt(tmp_path: Path) -> None:
    """The fleet's secret file: two frontends (their public settings loaded from the same flags, as `frontend` and
    `serve` do) and a router (cache_salt.load_secret) derive the same salt for a tenant; without the file each
    process draws its own secret and only the anonymous namespace is shared."""
    import argparse

    from pagedserve.services.common.cache_salt import CacheSaltSecretError, load_secret
    from pagedserve.services.frontend.generation import Serving
    from pagedserve.services.frontend.public_options import add_public_arguments, load_public_settings, public_flags

    secret = tmp_path / "secret"
    secret.write_bytes(bytes(range(40)))
    parser = argparse.ArgumentParser()
    add_public_arguments(parser)

    def frontend(*argv: str) -> Serving:
        settings = load_public_settings(parser.parse_args(list(argv)))
        return Serving(settings.keys, settings.limits, settings.cache_salt_secret)

    args = parser.parse_args(["--cache-salt-secret-file", str(secret)])
    assert public_flags(args) == ["--cache-salt-secret-file", str(secret), "--max-n", "16",
                                  "--max-streams-per-tenant", "128", "--max-message-bytes", str(4 << 20)]
    one, two = frontend(*public_flags(args)), frontend("--cache-salt-secret-file", str(secret))
    meta = [("x-cache-salt", "team-1")]
    router_side = tenant_salt(load_secret(str(secret)), "alpha", "team-1")
    assert one.salt("alpha", meta) == two.salt("alpha", meta) == router_side
    assert one.salt("alpha", []) == two.salt("alpha", []) != one.salt("beta", [])
    unshared = frontend()
    assert unshared.salt("alpha", []) != one.salt("alpha", []) and unshared.salt("", []) == one.salt("", []) == b""
    other = tmp_path / "other"
    other.write_bytes(bytes(range(1, 41)))
    assert frontend("--cache-salt-secret-file", str(other)).salt("alpha", []) != one.salt("alpha", [])
    other.write_bytes(b"x" * 31)
    with pytest.raises(CacheSaltSecretError, match=r"holds 31 bytes; the secret needs at least 32"):
        frontend("--cache-salt-secret-file", str(other))
    with pytest.raises(CacheSaltSecretError, match="cannot read it"):
        frontend("--cache-salt-secret-file", str(tmp_path / "missing"))


def test_limits_name_the_field_and_the_limit() -> None:
    limits = ApiLimits(max_prompt_tokens=10, max_new_tokens=8, max_n=2)
    limits.check(10, GenerationParams(max_tokens=8))
    with pytest.raises(InvalidRequest, match="prompt: 11 tokens exceed this server's limit of 10"):
        limits.check(11, GenerationParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="max_tokens: 9 exceeds this server's limit of 8"):
        limits.check(1, GenerationParams(max_tokens=9))
    assert limits.default_max_tokens == 8 and ApiLimits().default_max_tokens == 16
    ApiLimits().check(10**6, GenerationParams(max_tokens=10**6))  # no flags: the engine's context decides


def test_stream_counter_releases_however_the_stream_ends() -> None:
    streams = StreamCounter(limit=2)
    with streams.hold("alpha"), streams.hold("alpha"):
        with pytest.raises(OutOfCapacity, match="already has 2 requests in flight"), streams.hold("alpha"):
            pass
        with streams.hold("beta"):  # another tenant has its own count
            assert streams.in_flight("beta") == 1
    with pytest.raises(RuntimeError), streams.hold("alpha"):
        raise RuntimeError("the engine failed")
    assert streams.in_flight("alpha") == 0 and not streams._counts


@pytest.mark.parametrize(("listen", "local"), [
    ("unix:/run/pagedserve/executor.sock", True), ("127.0.0.1:50061", True), ("127.8.9.1:1", True),
    ("localhost:50061", True), ("[::1]:50061", True), ("0.0.0.0:50061", False), ("[::]:50061", False),
    (":50061", False), ("10.1.2.3:50061", False), ("pod.example:50061", False),
])
def test_sidecars_listen_only_on_this_machine(listen: str, local: bool) -> None:
    assert is_local_address(listen) == local
    if local:
        check_sidecar_listen("block manager", listen, allow_remote=False)
    else:
        with pytest.raises(SystemExit, match="--allow-remote"):
            check_sidecar_listen("block manager", listen, allow_remote=False)
    check_sidecar_listen("block manager", listen, allow_remote=True)


def test_tls_flags_are_checked_before_serving(tmp_path: Path) -> None:
    assert server_credentials(None, None, None) is None
    with pytest.raises(TlsConfigError, match="--tls-cert and --tls-key go together"):
        server_credentials("cert.pem", None, None)
    with pytest.raises(TlsConfigError, match="--tls-client-ca needs --tls-cert and --tls-key"):
        server_credentials(None, None, "ca.pem")
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("hello")
    with pytest.raises(TlsConfigError, match=r"--tls-key .*: not a PEM file"):
        server_credentials(str(not_pem), str(not_pem), None)
    with pytest.raises(TlsConfigError, match=r"--tls-key .*absent\.pem: cannot read it"):
        server_credentials(str(tmp_path / "absent.pem"), str(tmp_path / "absent.pem"), None)

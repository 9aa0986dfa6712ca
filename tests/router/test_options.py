"""`pagedserve router`'s flags: endpoints parsed and checked, files loaded at startup with the flag named."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagedserve.cli import build_parser
from pagedserve.services.common.cache_salt import CacheSaltSecretError
from pagedserve.services.router.options import RouterConfigError, endpoint_list, load_settings


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(["router", *argv]).parse_args(["router", *argv])


def test_endpoints() -> None:
    assert endpoint_list(" 10.0.0.1:50051, pod-b.ns.svc:50051,") == ["10.0.0.1:50051", "pod-b.ns.svc:50051"]
    assert endpoint_list("") == []
    with pytest.raises(argparse.ArgumentTypeError, match=r"'10\.0\.0\.1' is not HOST:PORT"):
        endpoint_list("10.0.0.1")
    with pytest.raises(argparse.ArgumentTypeError, match="listed twice"):
        endpoint_list("a:1,a:1")
    args = parse("--endpoints", "a:1,b:2", "--policy", "least-load")
    assert (args.endpoints, args.policy, args.listen) == (["a:1", "b:2"], "least-load", "127.0.0.1:50050")
    with pytest.raises(SystemExit):
        parse("--policy", "fastest")


def test_files_are_loaded_at_startup(tmp_path: Path) -> None:
    settings = load_settings(parse())
    assert settings.keys is None and settings.cache_salt_secret is None and settings.pod_metadata == ()
    (tmp_path / "key").write_text("router-key-0123456789\n")
    (tmp_path / "secret").write_bytes(b"x" * 32)
    settings = load_settings(parse("--pod-api-key-file", str(tmp_path / "key"),
                                   "--cache-salt-secret-file", str(tmp_path / "secret")))
    assert settings.pod_metadata == (("authorization", "Bearer router-key-0123456789"),)
    assert settings.cache_salt_secret is not None and len(settings.cache_salt_secret) == 64
    (tmp_path / "two").write_text("one two\n")
    with pytest.raises(RouterConfigError, match=r"--pod-api-key-file .*two: must hold one key"):
        load_settings(parse("--pod-api-key-file", str(tmp_path / "two")))
    (tmp_path / "short").write_bytes(b"x" * 8)
    with pytest.raises(CacheSaltSecretError, match="--cache-salt-secret-file"):
        load_settings(parse("--cache-salt-secret-file", str(tmp_path / "short")))
    with pytest.raises(RouterConfigError, match="--pod-tls-"):
        load_settings(parse("--pod-tls-cert", str(tmp_path / "key")))


def test_http_listen_and_the_pods_https(tmp_path: Path) -> None:
    assert parse().http_listen == "" and load_settings(parse()).pod_ssl is None
    assert load_settings(parse("--http-listen", "127.0.0.1:8000")).pod_ssl is None
    with pytest.raises(RouterConfigError, match=r"--http-listen '8000': expected HOST:PORT"):
        load_settings(parse("--http-listen", "8000"))
    (tmp_path / "not-a-ca.pem").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    with pytest.raises(RouterConfigError, match="--pod-tls-\\*: cannot load them for HTTPS"):
        load_settings(parse("--pod-tls-ca", str(tmp_path / "not-a-ca.pem")))

"""TLS from PEM files (issue 23) over real gRPC on 127.0.0.1: a CA and certificates made here with
`cryptography`; a TLS server refuses plain clients and clients that do not trust its CA; with
client authentication on, only clients presenting a certificate of the CA get in (mutual TLS);
API keys travel over it."""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvcore import keyfile, serving
from kvcore.channels import client_channel
from kvcore.config import PlannerConfig, SecurityConfig, from_env
from planner.service import build_service
from protos import planner_pb2, planner_pb2_grpc


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(d: Path, stem: str, key, cert) -> tuple[str, str]:
    (d / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(d / f"{stem}.pem"), str(d / f"{stem}.key")


def make_pki(d: Path, ca_name: str = "kvplan-test-ca") -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate -> PEM paths."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": _write(d, ca_name, ca_key, ca)[0]}
    for stem, san in (("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                      ("client", [x509.DNSName("kvplan-client")])):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(stem)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(san), critical=False)
                .sign(ca_key, hashes.SHA256()))
        out[f"{stem}_cert"], out[f"{stem}_key"] = _write(d, stem, key, cert)
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return {"ours": make_pki(d), "other": make_pki(tmp_path_factory.mktemp("pki-other"), "another-ca")}


async def _planner(sec: SecurityConfig):
    cfg = dataclasses.replace(from_env(PlannerConfig, {}), port=0)
    svc = build_service(cfg)
    server, port = await serving.start(svc, cfg, with_metrics=False, security=sec)
    assert await svc.warm_task is None
    return server, svc, f"127.0.0.1:{port}"


def _list(addr: str, sec: SecurityConfig):
    with client_channel(addr, sec=sec) as ch:
        return planner_pb2_grpc.PlannerStub(ch).ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)


def _refused(addr: str, sec: SecurityConfig) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        _list(addr, sec)
    return e.value.code()


async def test_tls_server_with_api_keys(pki, tmp_path, monkeypatch):
    p = pki["ours"]
    keys = tmp_path / "keys.json"
    key = keyfile.add_key(keys, "a", "user")
    server_sec = SecurityConfig(auth="on", keys_file=str(keys), tls_cert_file=p["server_cert"],
                                tls_key_file=p["server_key"])
    server, svc, addr = await _planner(server_sec)
    try:
        ok = SecurityConfig(tls_ca_file=p["ca"], api_key=key)
        assert (await _athread(_list, addr, ok)).active == "full"
        assert await _athread(_refused, addr, SecurityConfig(tls_ca_file=p["ca"])) == grpc.StatusCode.UNAUTHENTICATED
        assert await _athread(_refused, addr, SecurityConfig(api_key=key)) == grpc.StatusCode.UNAVAILABLE   # plain
        assert await _athread(_refused, addr, SecurityConfig(tls_ca_file=pki["other"]["ca"], api_key=key)) == \
            grpc.StatusCode.UNAVAILABLE                                                  # does not trust its CA
        monkeypatch.setenv("KVPLAN_TLS_CA_FILE", p["ca"])                                # health over TLS too
        assert await _athread(serving.check_health, addr) == "SERVING"
    finally:
        await serving.shutdown(server, svc, 0.5)


async def test_mutual_tls_needs_a_client_certificate_of_the_ca(pki):
    p, other = pki["ours"], pki["other"]
    sec = SecurityConfig(auth="off", tls_cert_file=p["server_cert"], tls_key_file=p["server_key"], tls_ca_file=p["ca"],
                         tls_client_auth=True)
    server, svc, addr = await _planner(sec)
    try:
        mutual = SecurityConfig(tls_ca_file=p["ca"], tls_cert_file=p["client_cert"], tls_key_file=p["client_key"])
        assert (await _athread(_list, addr, mutual)).active == "full"
        assert await _athread(_refused, addr, SecurityConfig(tls_ca_file=p["ca"])) == grpc.StatusCode.UNAVAILABLE
        stranger = SecurityConfig(tls_ca_file=p["ca"], tls_cert_file=other["client_cert"],
                                  tls_key_file=other["client_key"])
        assert await _athread(_refused, addr, stranger) == grpc.StatusCode.UNAVAILABLE
    finally:
        await serving.shutdown(server, svc, 0.5)


def test_tls_settings_are_checked():
    from kvcore.config import ConfigError
    with pytest.raises(ConfigError, match="go together"):
        SecurityConfig(tls_cert_file="a.pem")
    with pytest.raises(ConfigError, match="KVPLAN_TLS_CLIENT_AUTH needs"):
        SecurityConfig(tls_client_auth=True)
    with pytest.raises(ConfigError, match="KVPLAN_TLS_KEY_FILE=/nonexistent.key: No such file"):
        from kvcore.channels import server_credentials
        server_credentials(SecurityConfig(tls_cert_file="/nonexistent.pem", tls_key_file="/nonexistent.key"))


async def _athread(fn, *args):
    """A synchronous client call off the event loop the server runs on."""
    import asyncio
    return await asyncio.to_thread(fn, *args)

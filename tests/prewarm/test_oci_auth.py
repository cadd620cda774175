"""OCI staging from registries that ask for a login (issue #20, item 2), against real docker-registry
processes: one with ``auth: htpasswd`` (a Basic challenge, as docker-registry with htpasswd, Nexus and
many mirrors answer) and one with ``auth: token`` (a Bearer challenge whose realm is a token server
written here, issuing RS256 JWTs signed by a key whose certificate the registry trusts). Both stage
with credentials from a kubernetes.io/dockerconfigjson file, as the Job mounts it; wrong or missing
credentials end the attempt within seconds with a message naming the Secret."""

from __future__ import annotations

import base64
import datetime
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from prewarm.layout import ModelDir
from tests.prewarm.registry import ensure_registry_binary, running_registry

pytest.importorskip("oras")
bcrypt = pytest.importorskip("bcrypt")

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "puller", "s3cret-Pa55"
SECRET = "model-registry"
FILES = {"config.json": b'{"model_type": "granite"}', "model.safetensors": os.urandom(32 * 1024)}
FAST = 20.0  # seconds: a refused login must end the attempt well within this (the SDK's retries took 131 s)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """The registry's token realm: Basic credentials in, an RS256 JWT out (x5c: the trusted cert)."""

    def __init__(self, workdir: Path, service: str, issuer: str) -> None:
        pytest.importorskip("cryptography")
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding, rsa
        from cryptography.x509.oid import NameOID

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "noctaya test token issuer")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        self.cert_file = workdir / "token-cert.pem"
        self.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.requests: list[str] = []
        outer = self

        def sign(claims: dict) -> str:
            header = b64(json.dumps({"typ": "JWT", "alg": "RS256", "x5c": [x5c]}).encode())
            body = b64(json.dumps(claims).encode())
            signature = key.sign(f"{header}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())
            return f"{header}.{body}.{b64(signature)}"

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                outer.requests.append(self.path)
                query = parse_qs(urlparse(self.path).query)
                given = self.headers.get("Authorization", "")
                expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
                if given != expected:
                    self.send_response(401)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(b'{"details": "invalid credentials"}')
                    return
                access = []
                for scope in query.get("scope", []):
                    kind, repo, actions = scope.split(":")
                    access.append({"type": kind, "name": repo, "actions": actions.split(",")})
                t = int(time.time())
                token = sign({"iss": issuer, "sub": USER, "aud": service, "exp": t + 300, "nbf": t - 10, "iat": t,
                              "jti": str(uuid.uuid4()), "access": access})
                body = json.dumps({"token": token, "expires_in": 300}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.realm = f"http://127.0.0.1:{self.server.server_port}/token"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def basic_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ensure_registry_binary()
    root = tmp_path_factory.mktemp("basic-registry")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=5)).decode()
    (root / "htpasswd").write_text(f"{USER}:{hashed}\n")
    auth = f"auth:\n  htpasswd:\n    realm: Noctaya Test Realm\n    path: {root / 'htpasswd'}\n"
    with running_registry(root, auth) as address:
        yield address


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, TokenServer]]:
    ensure_registry_binary()
    root = tmp_path_factory.mktemp("token-registry")
    tokens = TokenServer(root, "noctaya-test-registry", "noctaya-test-issuer")
    auth = (f"auth:\n  token:\n    realm: {tokens.realm}\n    service: noctaya-test-registry\n"
            f"    issuer: noctaya-test-issuer\n    rootcertbundle: {tokens.cert_file}\n")
    try:
        with running_registry(root, auth) as address:
            yield address, tokens
    finally:
        tokens.close()


def push(address: str, repo: str, workdir: Path, tokens: TokenServer | None = None) -> str:
    """Push FILES as file layers, logged in as USER (Basic, or a pull+push token from ``tokens``: the
    SDK reuses a pull-only token for the upload); the manifest digest."""
    import hashlib

    import oras.oci
    import oras.provider
    import requests

    reg = oras.provider.Registry(insecure=True, auth_backend="basic" if tokens is None else "token")
    reg.auth.set_basic_auth(USER, PASSWORD)
    if tokens is not None:
        r = requests.get(tokens.realm, params={"service": "noctaya-test-registry", "scope": f"repository:{repo}:pull,push"},
                         auth=(USER, PASSWORD), timeout=10)
        reg.auth.set_token_auth(r.json()["token"])
    container = reg.get_container(f"{address}/{repo}:v1")
    manifest = oras.oci.NewManifest()
    for name, data in FILES.items():
        blob = workdir / name
        blob.write_bytes(data)
        layer = oras.oci.NewLayer(str(blob), media_type="application/vnd.oci.image.layer.v1.tar")
        layer["annotations"] = {"org.opencontainers.image.title": name}
        reg.upload_blob(str(blob), container, layer).raise_for_status()
        manifest["layers"].append(layer)
    conf, _ = oras.oci.ManifestConfig()
    empty = workdir / "empty-config.json"
    empty.write_text("{}")
    reg.upload_blob(str(empty), container, conf).raise_for_status()
    manifest["config"] = conf
    reg.upload_manifest(manifest, container).raise_for_status()
    r = reg.do_request(f"http://{container.manifest_url()}", "GET",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    r.raise_for_status()
    return "sha256:" + hashlib.sha256(r.content).hexdigest()


def docker_config(path: Path, server: str, user: str, password: str, style: str = "kubectl") -> Path:
    entry = {"username": user, "password": password, "auth": base64.b64encode(f"{user}:{password}".encode()).decode()}
    if style == "auth-only":  # what some tools write: no username/password fields
        entry = {"auth": entry["auth"]}
    path.write_text(json.dumps({"auths": {server: entry}}))
    return path


def stage_cli(tmp: Path, source: str, config: Path | None, secret: str | None = SECRET) -> tuple[subprocess.CompletedProcess[str], float, str]:
    term = tmp / "termination"
    term.unlink(missing_ok=True)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": "/nonexistent",
           "NOCTAYA_TERMINATION_LOG": str(term)}
    if config is not None:
        env["NOCTAYA_REGISTRY_CONFIG_FILE"] = str(config)
    if secret is not None:
        env["NOCTAYA_CREDENTIALS_SECRET"] = secret
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "prewarm", "oci", "--source", source, "--cache-dir", str(tmp / "cache"),
                           "--plain-http", "--progress-interval", "60"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    return done, time.monotonic() - started, term.read_text() if term.exists() else ""


def staged(tmp: Path, source: str) -> dict[str, bytes]:
    final = ModelDir.of(tmp / "cache", source, None).final
    return {str(p.relative_to(final)): p.read_bytes() for p in final.rglob("*") if p.is_file()}


@pytest.mark.parametrize("style", ["kubectl", "auth-only"])
def test_a_basic_auth_registry_stages_with_the_dockerconfigjson(basic_registry: str, tmp_path: Path, style: str) -> None:
    digest = push(basic_registry, "models/basic", tmp_path)
    source = f"oci://{basic_registry}/models/basic@{digest}"
    config = docker_config(tmp_path / "config.json", basic_registry, USER, PASSWORD, style)
    done, _, _ = stage_cli(tmp_path, source, config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Basic login" in done.stdout and f'Secret "{SECRET}"' in done.stdout
    assert staged(tmp_path, source) == FILES
    assert PASSWORD not in done.stdout + done.stderr


def test_a_token_auth_registry_stages_with_the_dockerconfigjson(token_registry: tuple[str, TokenServer],
                                                                tmp_path: Path) -> None:
    address, tokens = token_registry
    digest = push(address, "models/token", tmp_path, tokens)
    source = f"oci://{address}/models/token@{digest}"
    config = docker_config(tmp_path / "config.json", f"https://{address}/", USER, PASSWORD)  # a key with a scheme
    tokens.requests.clear()
    done, _, _ = stage_cli(tmp_path, source, config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "token login" in done.stdout
    assert staged(tmp_path, source) == FILES
    assert any("scope=repository%3Amodels%2Ftoken%3Apull" in r for r in tokens.requests), tokens.requests
    assert PASSWORD not in done.stdout + done.stderr


@pytest.mark.parametrize("kind", ["basic", "token"])
def test_wrong_credentials_fail_fast_naming_the_secret(basic_registry: str, token_registry: tuple[str, TokenServer],
                                                       tmp_path: Path, kind: str) -> None:
    address = basic_registry if kind == "basic" else token_registry[0]
    digest = push(address, f"models/wrong-{kind}", tmp_path, None if kind == "basic" else token_registry[1])
    source = f"oci://{address}/models/wrong-{kind}@{digest}"
    config = docker_config(tmp_path / "config.json", address, USER, "not-the-password")
    done, took, term = stage_cli(tmp_path, source, config)
    assert done.returncode == 1, done.stdout + done.stderr
    assert took < FAST, f"a refused login took {took:.1f} s"
    assert f'refused the credentials for {address} from Secret "{SECRET}"' in term, term
    assert "Traceback" not in done.stdout + done.stderr and "not-the-password" not in done.stdout + done.stderr + term
    assert not ModelDir.of(tmp_path / "cache", source, None).marker.exists()


@pytest.mark.parametrize("kind", ["basic", "token"])
def test_a_secret_for_another_server_or_none_says_so(basic_registry: str, token_registry: tuple[str, TokenServer],
                                                     tmp_path: Path, kind: str) -> None:
    address = basic_registry if kind == "basic" else token_registry[0]
    digest = push(address, f"models/other-{kind}", tmp_path, None if kind == "basic" else token_registry[1])
    source = f"oci://{address}/models/other-{kind}@{digest}"
    config = docker_config(tmp_path / "config.json", "registry.example.com", USER, PASSWORD)
    done, took, term = stage_cli(tmp_path, source, config)
    assert done.returncode == 1 and took < FAST, done.stdout
    assert f'Secret "{SECRET}" has no credentials for {address} (it has: registry.example.com)' in term, term
    done, took, term = stage_cli(tmp_path, source, None, secret=None)
    assert done.returncode == 1 and took < FAST, done.stdout
    assert "no credentials were given: set model.credentialsSecret" in term, term

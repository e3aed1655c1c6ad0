"""Pushing images with the OCI distribution API (rolloutfleet_testkit.images.registry) to a real
registry: CNCF Distribution's `registry`, built from the Go module proxy on first use (cached per
version, like promtool), serving 127.0.0.1 from a temporary directory. What was pushed is read back
with plain HTTP requests (not the pusher's code) and checked digest by digest."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rolloutfleet_testkit.controlplane.build import ensure_registry
from rolloutfleet_testkit.images import registry as oci_registry
from rolloutfleet_testkit.images.catalog import build_image, push_images
from rolloutfleet_testkit.images.registry import Blob, PushError, credentials, parse_challenge, push, target
from rolloutfleet_testkit.processes import ServerProcess, free_port

ACCEPT = {"Accept": oci_registry.MANIFEST_TYPE}


@pytest.fixture(scope="module")
def registry_binary() -> Path:
    return ensure_registry()  # built once (about a minute on 2 cores), then cached per version


def serve(binary: Path, root: Path, htpasswd: Path | None = None) -> tuple[ServerProcess, str]:
    port = free_port()
    auth = f"auth:\n  htpasswd: {{realm: test, path: {htpasswd}}}\n" if htpasswd else ""
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\nlog: {level: warn}\n"
        f"storage:\n  filesystem: {{rootdirectory: {root / 'data'}}}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n{auth}"
    )
    # No tracing exporter: the registry would otherwise try an OTLP collector on localhost.
    process = ServerProcess([str(binary), "serve", str(config)], env={"OTEL_TRACES_EXPORTER": "none"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:  # /v2/ answers 200, or 401 with auth: either means it serves
        try:
            if httpx.get(f"{url}/v2/", timeout=2).status_code in (200, 401):
                return process, url
        except httpx.TransportError:
            pass
        if process.process.poll() is not None or time.monotonic() > deadline:
            process.terminate()
            raise RuntimeError(f"the registry did not start:\n{process.log_tail()}")
        time.sleep(0.1)


@pytest.fixture
def registry(registry_binary, tmp_path) -> Iterator[str]:
    process, url = serve(registry_binary, tmp_path)
    with process:
        yield url


def read_back(url: str, repository: str, tag: str, auth=None) -> tuple[str, dict, list[bytes]]:
    """The manifest's digest, the manifest and its blobs, each blob checked against its digest."""
    answer = httpx.get(f"{url}/v2/{repository}/manifests/{tag}", headers=ACCEPT, auth=auth)
    assert answer.status_code == 200, answer.text
    digest = "sha256:" + hashlib.sha256(answer.content).hexdigest()
    assert answer.headers["Docker-Content-Digest"] == digest
    manifest = answer.json()
    blobs = []
    for descriptor in [manifest["config"], *manifest["layers"]]:
        blob = httpx.get(
            f"{url}/v2/{repository}/blobs/{descriptor['digest']}", auth=auth, follow_redirects=True
        )
        assert blob.status_code == 200
        assert "sha256:" + hashlib.sha256(blob.content).hexdigest() == descriptor["digest"]
        assert len(blob.content) == descriptor["size"]
        blobs.append(blob.content)
    return digest, manifest, blobs


@pytest.mark.registry
def test_an_image_pushed_reads_back_blob_for_blob(registry):
    built = build_image("busybox")  # the small static image of the catalog (a prebuilt archive)
    started = time.monotonic()
    # Chunks of 256 KiB: busybox's ~1 MiB compressed layer goes up in PATCHes, the config whole.
    (reference,) = push_images(["busybox"], registry, chunk_bytes=256 << 10)["busybox"]
    took = time.monotonic() - started
    host = registry.removeprefix("http://")
    assert reference.startswith(f"{host}/busybox:1.36@sha256:")
    digest, manifest, (config, layer) = read_back(registry, "busybox", "1.36")
    assert reference.endswith(f"@{digest}")
    assert manifest["mediaType"] == oci_registry.MANIFEST_TYPE
    assert [d["mediaType"] for d in manifest["layers"]] == [oci_registry.LAYER_TYPE]
    # The config is the archive's own, byte for byte; the layer unpacks to the archive's layer.
    expected_config, (expected_layer,) = built.blobs()
    assert config == expected_config.data
    diff_id = json.loads(config)["rootfs"]["diff_ids"][0]
    assert "sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest() == diff_id
    assert json.loads(config)["config"]["Entrypoint"] == ["/bin/busybox"]
    print(f"pushed busybox ({expected_layer.size} bytes compressed) in {took:.2f}s")
    # Pushing again uploads nothing (every blob is there) and names the same manifest.
    again = push_images(["busybox"], registry)["busybox"]
    assert again == [reference]


@pytest.mark.registry
def test_whole_and_chunked_uploads_store_the_same_blob(registry, tmp_path):
    data = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and 4 bytes: chunks of 64 KiB leave a short last one
    path = tmp_path / "blob"
    path.write_bytes(data)
    blob = Blob(
        "application/octet-stream", "sha256:" + hashlib.sha256(data).hexdigest(), len(data), path=path
    )
    config = Blob.of_bytes(oci_registry.CONFIG_TYPE, b'{"architecture":"amd64","os":"linux","rootfs":{}}')
    for repository, chunk_bytes, kind in (("whole", 8 << 20, "monolithic"), ("chunked", 64 << 10, "chunked")):
        with oci_registry.Registry(registry, chunk_bytes=chunk_bytes) as client:
            client.push_blob(repository, blob)
            assert client.uploads[kind] == 1
            client.push_blob(repository, blob)
            assert client.uploads["present"] == 1
        stored = httpx.get(f"{registry}/v2/{repository}/blobs/{blob.digest}", follow_redirects=True)
        assert stored.content == data
    digest = push(config, [blob], target(registry, "whole:v1"))
    assert read_back(registry, "whole", "v1")[0] == digest


@pytest.mark.registry
def test_a_registry_with_basic_auth_takes_the_credentials_and_refuses_others(registry_binary, tmp_path):
    with warnings.catch_warnings():  # crypt (deprecated, still in 3.11) makes the bcrypt entry htpasswd needs
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        entry = crypt.crypt("s3cret", crypt.mksalt(crypt.METHOD_BLOWFISH))
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(f"pusher:{entry}\n")
    process, url = serve(registry_binary, tmp_path, htpasswd)
    config, layers = build_image("busybox").blobs()
    with process:
        with pytest.raises(PushError, match="credentials"):
            push(config, layers, target(url, "busybox:auth"), auth=None)
        with pytest.raises(PushError, match="401"):
            push(config, layers, target(url, "busybox:auth"), auth=("pusher", "wrong"))
        digest = push(config, layers, target(url, "busybox:auth"), auth=("pusher", "s3cret"))
        assert read_back(url, "busybox", "auth", auth=("pusher", "s3cret"))[0] == digest
        assert httpx.get(f"{url}/v2/busybox/manifests/auth", headers=ACCEPT).status_code == 401


def test_registry_targets_challenges_and_docker_login_credentials(tmp_path):
    assert target("ghcr.io/acme", "rolloutfleet-proxy:1.2.3") == oci_registry.Target(
        "https://ghcr.io", "acme/rolloutfleet-proxy", "1.2.3", "ghcr.io"
    )
    hub = target("docker.io/acme", "rolloutfleet-proxy:1.2.3")
    assert hub.base_url == "https://registry-1.docker.io"  # Docker Hub's API host
    assert hub.reference == "docker.io/acme/rolloutfleet-proxy:1.2.3"
    local = target("http://127.0.0.1:5000/", "busybox")
    assert (local.base_url, local.repository, local.tag) == ("http://127.0.0.1:5000", "busybox", "latest")
    assert local.reference == "127.0.0.1:5000/busybox:latest"
    assert target("registry.example.com:5000/a/b", "x:1").reference == "registry.example.com:5000/a/b/x:1"
    with pytest.raises(ValueError):
        target("ftp://host", "x:1")
    scheme, params = parse_challenge(
        'Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:push,pull"'
    )
    assert scheme == "bearer"
    assert params == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:a/b:push,pull",
    }
    assert parse_challenge('Basic realm="test"') == ("basic", {"realm": "test"})
    (tmp_path / ".docker").mkdir()
    auth = base64.b64encode(b"robot:p:w").decode()
    (tmp_path / ".docker" / "config.json").write_text(json.dumps({"auths": {"ghcr.io": {"auth": auth}}}))
    assert credentials("ghcr.io", environ={}, home=tmp_path) == ("robot", "p:w")
    assert credentials("quay.io", environ={}, home=tmp_path) is None
    environ = {oci_registry.USERNAME_ENV: "u", oci_registry.PASSWORD_ENV: "p"}
    assert credentials("ghcr.io", environ=environ, home=tmp_path) == ("u", "p")


@pytest.mark.registry
def test_the_registry_is_the_pinned_release_cached_per_version(registry_binary):
    from rolloutfleet_testkit.controlplane.build import REGISTRY_VERSION, go_tool_path

    assert registry_binary == go_tool_path("registry", REGISTRY_VERSION)
    version = subprocess.run([registry_binary, "--version"], capture_output=True, text=True, check=True)
    assert f" {REGISTRY_VERSION}" in version.stdout

"""The local image builder's pure parts (rolloutfleet_testkit.images): layers as deterministic tars,
the image archive read back (names, digests, config), the Dockerfile reader, what COPY brings in,
and SGLang's command line for the SGLang emulator. The Dockerfile instruction basics and name
normalization are in test_node_and_images_units.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from rolloutfleet_testkit.images import build, dockerfile
from rolloutfleet_testkit.images.build import (
    BuildState,
    content_key,
    context_files,
    copy_into,
    ignore_patterns,
    layer_tar,
)
from rolloutfleet_testkit.images.catalog import image_name
from rolloutfleet_testkit.images.oci import tar_layer, write_image_archive
from rolloutfleet_testkit.sglang_args import launch_flags
from rolloutfleet_testkit.sglang_emulator.sglang_cli import emulator_args
from rolloutfleet_testkit.upstream_stub import stand_in_args

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="owners and device nodes need root")


def a_tree(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tool").write_bytes(b"#!/bin/sh\necho hi\n")
    (root / "bin" / "tool").chmod(0o755)
    os.link(root / "bin" / "tool", root / "bin" / "same-tool")
    (root / "bin" / "alias").symlink_to("tool")
    (root / "etc").mkdir()
    (root / "etc" / "z.conf").write_text("z\n")
    (root / "etc" / "a.conf").write_text("a\n")
    return root


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_layer_is_the_same_bytes_for_the_same_tree_whenever_it_is_written(tmp_path):
    tree = a_tree(tmp_path / "tree")
    first = tar_layer(tree, tmp_path / "1.tar")
    os.utime(tree / "etc" / "a.conf", (1, 1))  # times change, content does not
    second = tar_layer(tree, tmp_path / "2.tar")
    assert digest(first) == digest(second)
    with tarfile.open(first) as read:
        members = {m.name.removeprefix("./"): m for m in read.getmembers()}
    names = [n for n in members if n and n != "."]
    assert names == sorted(names), "entries are sorted"
    assert {m.mtime for m in members.values()} == {0}
    assert members["bin/alias"].issym() and members["bin/alias"].linkname == "tool"
    # One of the two names of the hard-linked file holds the data, the other links to it.
    pair = (members["bin/same-tool"], members["bin/tool"])
    assert sorted(m.islnk() for m in pair) == [False, True]
    assert members["bin/tool"].mode & 0o777 == 0o755


def test_a_layer_can_keep_the_trees_own_times(tmp_path):
    tree = a_tree(tmp_path / "tree")
    os.utime(tree / "etc" / "a.conf", (1_700_000_000, 1_700_000_000))
    with tarfile.open(tar_layer(tree, tmp_path / "l.tar", mtime=None)) as read:
        assert read.getmember("./etc/a.conf").mtime == 1_700_000_000


@root_only
def test_a_layer_keeps_numeric_owners(tmp_path):
    tree = a_tree(tmp_path / "tree")
    os.chown(tree / "etc" / "a.conf", 65532, 1234)
    with tarfile.open(tar_layer(tree, tmp_path / "l.tar")) as read:
        member = read.getmember("./etc/a.conf")
    assert (member.uid, member.gid, member.uname, member.gname) == (65532, 1234, "", "")


@root_only
def test_an_overlay_upper_directory_becomes_a_layer_with_whiteouts(tmp_path):
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc" / "new.conf").write_text("n\n")
    os.mknod(upper / "etc" / "gone.conf", 0o600 | 0o020000, os.makedev(0, 0))  # overlay's whiteout
    with tarfile.open(layer_tar(upper, tmp_path / "layer.tar")) as read:
        names = read.getnames()
    assert "etc/.wh.gone.conf" in names and "etc/new.conf" in names and "etc/gone.conf" not in names


def test_an_image_archive_read_back_holds_its_layers_config_and_names(tmp_path):
    base = tar_layer(a_tree(tmp_path / "base"), tmp_path / "base.tar")
    (tmp_path / "top" / "app").mkdir(parents=True)
    (tmp_path / "top" / "app" / "main.py").write_text("print('hi')\n")
    top = tar_layer(tmp_path / "top", tmp_path / "top.tar")
    config = {
        "Entrypoint": ["rolloutfleet-proxy"],
        "Cmd": ["--help"],
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
        "WorkingDir": "/src",
        "User": "65532:65532",
        "ExposedPorts": {"8000/tcp": {}},
        "Labels": {"a": "b"},
    }
    names = [image_name("proxy"), "rolloutfleet.local/pause:1"]
    archive = write_image_archive(tmp_path / "image.tar", [base, top], config, names)
    with tarfile.open(archive) as read:
        (entry,) = json.loads(read.extractfile("manifest.json").read())
        config_bytes = read.extractfile(entry["Config"]).read()
        blobs = [read.extractfile(name).read() for name in entry["Layers"]]
    assert entry["RepoTags"] == names
    assert entry["Config"] == f"{hashlib.sha256(config_bytes).hexdigest()}.json"
    image = json.loads(config_bytes)
    diff_ids = [f"sha256:{hashlib.sha256(blob).hexdigest()}" for blob in blobs]
    assert blobs == [base.read_bytes(), top.read_bytes()]
    assert image["rootfs"] == {"type": "layers", "diff_ids": diff_ids}
    assert [name.split("/")[0] for name in entry["Layers"]] == [d.removeprefix("sha256:") for d in diff_ids]
    assert image["config"] == config and image["os"] == "linux"
    again = write_image_archive(tmp_path / "again.tar", [base, top], config, names)
    assert digest(again) == digest(archive), "the same image gives the same archive"


def test_an_image_needs_a_layer_and_a_name(tmp_path):
    layer = tar_layer(a_tree(tmp_path / "t"), tmp_path / "l.tar")
    with pytest.raises(ValueError):
        write_image_archive(tmp_path / "x.tar", [layer], {}, [])
    with pytest.raises(ValueError):
        write_image_archive(tmp_path / "x.tar", [], {}, ["a:1"])


def test_continuations_comments_and_blank_lines_inside_an_instruction():
    text = (
        "# syntax comment\n"
        "ARG BASE=python:3.11-slim\n"
        "FROM ${BASE}\n"
        "RUN apt-get update \\\n"
        "    # a comment inside the continuation\n"
        "\n"
        "    && echo done\n"
        'ENTRYPOINT ["python", "-c", "print(\\"a b\\")"]\n'
        "CMD echo $HOME\n"
        "ENV LEGACY value with spaces\n"
        'LABEL org.example.title="the proxy" version=1\n'
        "expose 8000 9000/udp\n"
    )
    parsed = dockerfile.parse(text)
    keywords = ["ARG", "FROM", "RUN", "ENTRYPOINT", "CMD", "ENV", "LABEL", "EXPOSE"]
    assert [i.keyword for i in parsed] == keywords
    assert parsed[2].text == "apt-get update && echo done" and parsed[2].line == 4
    assert parsed[3].exec_form == ["python", "-c", 'print("a b")']
    assert parsed[4].exec_form is None and parsed[4].text == "echo $HOME"
    assert dockerfile.key_values(parsed[5].text) == {"LEGACY": "value with spaces"}
    assert dockerfile.key_values(parsed[6].text) == {"org.example.title": "the proxy", "version": "1"}


def test_an_unknown_instruction_is_named_with_its_line():
    with pytest.raises(dockerfile.DockerfileError, match="line 3: unsupported instruction ADD"):
        dockerfile.parse("FROM x\n\nADD a b\n")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$A/${B}", "1/two"),
        ("${UNSET}|$UNSET|", "||"),
        ("${UNSET:-fallback} ${A:-unused}", "fallback 1"),
        ("${A:+alt}${UNSET:+alt}", "alt"),
        ("pre${A}post", "pre1post"),
    ],
)
def test_variable_substitution(text, expected):
    assert dockerfile.substitute(text, {"A": "1", "B": "two"}) == expected


def a_context(root: Path) -> Path:
    (root / "proxy" / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "proxy" / "pkg" / "__init__.py").write_text("")
    (root / "proxy" / "pkg" / "app.py").write_text("APP = 1\n")
    (root / "proxy" / "pkg" / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"\0")
    (root / "proxy" / "notes.tmp").write_text("scratch\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref\n")
    (root / "pyproject.toml").write_text("[project]\n")
    (root / ".dockerignore").write_text("# scratch files\n**/*.tmp\n")
    return root


def test_copy_brings_the_context_minus_what_is_ignored_and_its_key_follows_the_content(tmp_path):
    context = a_context(tmp_path / "ctx")
    patterns = ignore_patterns(context)
    files = context_files(context, "proxy", patterns)
    assert [f.as_posix() for f in files] == ["proxy/pkg/__init__.py", "proxy/pkg/app.py"]
    assert context_files(context, ".", patterns) == [Path(".dockerignore"), *files, Path("pyproject.toml")]
    key = content_key(context, files)
    (context / "proxy" / "notes.tmp").write_text("ignored changes change nothing\n")
    assert content_key(context, context_files(context, "proxy", patterns)) == key
    (context / "proxy" / "pkg" / "app.py").write_text("APP = 2\n")
    changed = content_key(context, files)
    assert changed != key
    (context / "proxy" / "pkg" / "app.py").chmod(0o755)
    assert content_key(context, files) != changed, "a mode is content too"
    with pytest.raises(ValueError, match="outside the build context"):
        context_files(context, "../elsewhere", patterns)


def test_copy_places_directories_contents_and_files_as_docker_does(tmp_path):
    context = a_context(tmp_path / "ctx")
    merged = tmp_path / "merged"
    state = BuildState(key="k", workdir="/src")
    patterns = ignore_patterns(context)

    def copy(text: str) -> None:
        instruction = dockerfile.parse(f"FROM x\nCOPY {text}")[1]
        sources = text.split()[:-1]
        files = [f for s in sources for f in context_files(context, s, patterns)]
        copy_into(merged, context, state, instruction, files)

    copy("proxy ./proxy")  # a directory's contents, under the destination
    copy("pyproject.toml ./")  # a file into a directory, relative to WORKDIR
    copy("pyproject.toml /etc/renamed.toml")  # a file to a new name
    assert (merged / "src/proxy/pkg/app.py").read_text() == "APP = 1\n"
    assert not (merged / "src/proxy/pkg/__pycache__").exists()
    assert (merged / "src/pyproject.toml").exists() and (merged / "etc/renamed.toml").exists()


def test_sglang_flags_in_every_spelling_become_the_emulators():
    args = [
        "--model", "/weights", "--port=30001", "--trust-remote-code", "--log-level", "debug",
        "stray", "--context-length", "4096", "--weight-version", "v2", "--tp-size=4",
        "--enable-metrics", "--dtype", "bfloat16",
    ]  # fmt: skip
    assert emulator_args(args) == [
        "--port", "30001", "--log-level", "debug", "--context-length", "4096",
        "--weight-version", "v2", "--tokenizer-path", "/weights",
    ]  # fmt: skip
    assert emulator_args([]) == []
    assert emulator_args(["--tp-size", "8", "--host", "::"]) == ["--host", "::"]
    assert emulator_args(["--max-total-tokens", "700000"]) == ["--cache-capacity-tokens", "700000"]


def test_the_fixed_latency_stand_in_takes_where_to_listen_from_sglangs_command_line():
    """What the operator runs in an engine pod, read by the stand-in in the test kit's image."""
    args = ["--model-path", "/models", "--host", "0.0.0.0", "--port=30000", "--tp-size", "1", "--enable-x"]
    assert stand_in_args(args) == ["--host", "0.0.0.0", "--port", "30000"]
    assert stand_in_args(["--tp-size", "2"]) == []
    assert launch_flags(["x", "--a", "1", "--b", "--c=3", "--d"]) == {
        "--a": "1",
        "--b": None,
        "--c": "3",
        "--d": None,
    }


def test_pruning_keeps_the_steps_of_the_current_builds_only(tmp_path, monkeypatch):
    from rolloutfleet_testkit.images import build as build_module

    monkeypatch.setattr(build_module, "images_cache", lambda: tmp_path)
    steps = tmp_path / "layers"
    current, stale, other = steps / "current", steps / "stale", steps / "other-checkout"
    for step in (current, stale, other):
        (step / "upper").mkdir(parents=True)
        (step / "layer.tar").write_bytes(b"layer")
    day_ago = time.time() - build_module.PRUNE_UNUSED_FOR_S - 60
    os.utime(stale, (day_ago, day_ago))
    # `other` is not the current builds' but was used within the day (another checkout's image, maybe
    # running): kept. `stale` was not used for a day: removed.
    assert build_module.prune_layers({current}) == [stale]
    assert current.exists() and other.exists() and not stale.exists()
    assert build_module.prune_layers({current}) == []


def test_pruning_a_step_a_killed_build_left_mounted_never_deletes_through_its_mounts(tmp_path, monkeypatch):
    """A RUN killed with SIGKILL leaves the host's /dev (and /proc, /sys) bound inside its step: the
    prune unmounts them first. Here a real bind mount of a directory standing for /dev."""
    from rolloutfleet_testkit.images import build as build_module

    if os.geteuid() != 0:
        pytest.skip("mounts need root (the image builds run as root)")
    monkeypatch.setattr(build_module, "images_cache", lambda: tmp_path)
    host_dev = tmp_path / "host-dev"
    host_dev.mkdir()
    (host_dev / "null").write_text("a device")
    stale = tmp_path / "layers" / "stale"
    target = stale / "scratch" / "merged with blank" / "dev"
    target.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(host_dev), str(target)], check=True)
    try:
        assert build_module.mounts_under(stale) == [target]
        day_ago = time.time() - build_module.PRUNE_UNUSED_FOR_S - 60
        os.utime(stale, (day_ago, day_ago))
        assert build_module.prune_layers(set()) == [stale]
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)
    assert not stale.exists()
    assert (host_dev / "null").read_text() == "a device", "deleted through the mount"


def test_from_names_a_base_or_an_earlier_stage_and_copy_takes_from():
    assert dockerfile.stage_source("python:3.11-slim") == ("python:3.11-slim", None)
    assert dockerfile.stage_source("python:3.11-slim AS Builder") == ("python:3.11-slim", "builder")
    assert dockerfile.stage_source("builder as final") == ("builder", "final")
    with pytest.raises(dockerfile.DockerfileError):
        dockerfile.stage_source("python:3.11-slim builder")
    (_, copy) = dockerfile.parse("FROM x\nCOPY --from=builder /opt/venv /opt/venv\n")
    assert copy.flag("from") == ["builder"] and copy.text == "/opt/venv /opt/venv"


def test_copy_from_a_stage_keeps_links_modes_and_times(tmp_path):
    tree, merged = a_tree(tmp_path / "stage" / "opt" / "env").parents[1], tmp_path / "merged"
    os.utime(tree / "opt/env/etc/a.conf", (1_700_000_000, 1_700_000_000))
    build.copy_from_tree(tree, merged, ["/opt/env"], "/opt/env", "/")
    build.copy_from_tree(tree, merged, ["opt/env/etc/a.conf", "/opt/env/bin/tool"], "conf/", "/srv")
    build.copy_from_tree(tree, merged, ["/opt/env/etc/z.conf"], "/etc/renamed.conf", "/")
    assert (merged / "opt/env/bin/alias").is_symlink() and os.readlink(merged / "opt/env/bin/alias") == "tool"
    assert (merged / "opt/env/bin/tool").stat().st_mode & 0o777 == 0o755
    assert (merged / "opt/env/etc/a.conf").stat().st_mtime == 1_700_000_000
    assert (merged / "srv/conf/a.conf").read_text() == "a\n" and (merged / "srv/conf/tool").exists()
    assert (merged / "etc/renamed.conf").read_text() == "z\n"
    with pytest.raises(ValueError, match="no /opt/missing"):
        build.copy_from_tree(tree, merged, ["/opt/missing"], "/x", "/")
    with pytest.raises(ValueError, match=r"no \.\./\.\./etc"):
        build.copy_from_tree(tree, merged, ["../../etc"], "/x", "/")


MULTI_STAGE = """\
ARG BASE=python:3.11-slim@sha256:0000000000000000000000000000000000000000000000000000000000000000
FROM ${BASE} AS builder
WORKDIR /opt/app
COPY proxy ./proxy
COPY pyproject.toml ./
FROM builder AS tested
ENV ONLY_IN_TESTED=1
FROM ${BASE}
COPY --from=builder /opt/app /opt/app
COPY --from=0 /opt/app/pyproject.toml /etc/
ARG VERSION=0.0.0
LABEL org.opencontainers.image.version="${VERSION}"
"""


@root_only
def test_a_multi_stage_build_keeps_the_last_stage_only(tmp_path, monkeypatch):
    from rolloutfleet_testkit.images import base as base_image

    # A tiny stand-in base (a debootstrapped one is built by the image e2e tests).
    rootfs = tmp_path / "base" / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "os-release").write_text("ID=stand-in\n")
    base_tar = tar_layer(rootfs, tmp_path / "base" / "layer.tar")
    monkeypatch.setattr(base_image, "base_layer", lambda: base_tar)
    monkeypatch.setattr(base_image, "base_rootfs", lambda: rootfs)
    monkeypatch.setattr(base_image, "base_key", lambda: "stand-in")
    monkeypatch.setattr(build, "images_cache", lambda: tmp_path / "cache")
    context = a_context(tmp_path / "ctx")
    (context / "Dockerfile").write_text(MULTI_STAGE)

    layers, config, key = build.build(context / "Dockerfile", context, {"VERSION": "9.8.7"})
    assert layers[0] == base_tar and len(layers) == 3  # the base and the two COPY --from layers
    names = []
    for layer in layers[1:]:
        with tarfile.open(layer) as read:
            names.append({name.removeprefix("./") for name in read.getnames()})
    assert {"opt/app/proxy/pkg/app.py", "opt/app/pyproject.toml"} <= names[0]
    assert "opt/app/proxy/notes.tmp" not in names[0]  # .dockerignore held for the builder's COPY
    assert names[1] == {"etc", "etc/pyproject.toml"}
    assert config["Labels"] == {"org.opencontainers.image.version": "9.8.7"}
    assert not any(e.startswith("ONLY_IN_TESTED") for e in config["Env"]) and config["WorkingDir"] == "/"
    # Cached: the same build again is the same image; a source the builder copies changes it.
    assert build.build(context / "Dockerfile", context, {"VERSION": "9.8.7"})[2] == key
    (context / "proxy" / "pkg" / "app.py").write_text("APP = 2\n")
    changed, _, changed_key = build.build(context / "Dockerfile", context, {"VERSION": "9.8.7"})
    assert changed_key != key and changed[1] != layers[1] and changed[2] != layers[2]
    with tarfile.open(changed[1]) as read:
        assert read.extractfile("opt/app/proxy/pkg/app.py").read() == b"APP = 2\n"
    # Pruning to the image's layers keeps the builder's steps too (the next build reuses them) and
    # removes the first build's.
    steps = tmp_path / "cache" / "layers"
    before = set(steps.iterdir())
    removed = build.prune_layers({layer.parent for layer in changed[1:]}, unused_for_s=0)
    assert {layer.parent for layer in layers[1:]} <= set(removed)
    kept = set(steps.iterdir())
    assert kept == before - set(removed) and len(kept) == len(changed[1:]) + 3  # + WORKDIR and two COPYs
    assert build.build(context / "Dockerfile", context, {"VERSION": "9.8.7"})[2] == changed_key
    assert set(steps.iterdir()) == kept, "nothing was built again"
    (context / "Dockerfile").write_text(MULTI_STAGE.replace("--from=0", "--from=nowhere"))
    with pytest.raises(ValueError, match="no earlier stage"):
        build.build(context / "Dockerfile", context)


def test_two_builders_of_the_base_image_take_turns(tmp_path, monkeypatch):
    """A second process building the base at once removed the tree under the first one's debootstrap
    (a cold CI run beside another checkout): the build is under the cache's lock."""
    from concurrent.futures import ThreadPoolExecutor

    from rolloutfleet_testkit.images import base

    monkeypatch.setenv("ROLLOUTFLEET_CACHE", str(tmp_path))
    inside, most = [], []

    def building() -> Path:
        inside.append(1)
        most.append(len(inside))
        time.sleep(0.3)
        inside.pop()
        return tmp_path / "layer.tar"

    monkeypatch.setattr(base, "_base_layer", building)
    with ThreadPoolExecutor(2) as pool:  # flock locks conflict across open files, threads included
        list(pool.map(lambda _: base.base_layer(), range(2)))
    assert most == [1, 1]


def test_the_test_kit_images_sglang_shim_serves_the_fixed_latency_stand_in_as_the_operator_runs_engines():
    """The engine container's command (`python3 -m sglang.launch_server` with the operator's flags),
    the shim on PYTHONPATH as a fleet's `engines.env` puts it: the stand-in answers the readiness
    probe's /health and a /generate on the port it was given."""
    from rolloutfleet_testkit.processes import ServerProcess, free_port, python_module

    port = free_port()
    shim = Path(__file__).resolve().parents[2] / "images" / "testkit" / "sglang_shim"
    args = ["--model-path", "/models", "--host", "127.0.0.1", "--port", str(port), "--tp-size", "1"]
    with ServerProcess(python_module("sglang.launch_server", *args), env={"PYTHONPATH": str(shim)}) as engine:
        engine.wait_ready(f"http://127.0.0.1:{port}/health")
        answer = httpx.post(
            f"http://127.0.0.1:{port}/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
            timeout=30,
        ).json()
    assert answer["output_ids"] and answer["meta_info"]["prompt_tokens"] == 3

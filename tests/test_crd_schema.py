"""The CRD file itself: every schema node uses only OpenAPI schema keywords (a stray key, e.g. from a
comma inside an unquoted YAML flow mapping, is dropped silently on create and rejected on update)."""

from __future__ import annotations

from pathlib import Path

import yaml

CRD = Path(__file__).resolve().parent.parent / "crds" / "rolloutfleets.rolloutfleet.dev.yaml"
SCHEMA_KEYWORDS = {
    "type",
    "format",
    "description",
    "properties",
    "items",
    "required",
    "default",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "minLength",
    "minItems",
    "pattern",
    "additionalProperties",
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}


def schema_nodes(node: dict, path: str = "openAPIV3Schema"):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from schema_nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")


def test_every_schema_node_uses_only_schema_keywords():
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    stray = {
        path: sorted(set(node) - SCHEMA_KEYWORDS)
        for path, node in schema_nodes(version["schema"]["openAPIV3Schema"])
        if set(node) - SCHEMA_KEYWORDS
    }
    assert not stray, f"keys that are not schema keywords: {stray}"


def test_every_field_has_a_description_for_kubectl_explain():
    crd = yaml.safe_load(CRD.read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    undocumented = [
        path
        for section in ("spec", "status")
        for path, node in schema_nodes(root["properties"][section], section)
        if path.rsplit(".", 1)[-1] not in ("[]", "{}")
        and not path.endswith(("[]", "{}"))
        and not node.get("description")
    ]
    assert not undocumented, f"fields kubectl explain would show without a description: {undocumented}"

"""The CRD file itself: it is generated from crds/source/ with Kubernetes' own schemas and is current;
every schema node uses only OpenAPI schema keywords (a stray key, e.g. from a comma inside an
unquoted YAML flow mapping, is dropped silently on create and rejected on update); and its OpenAPI
part (types, enums, bounds, patterns) accepts and rejects what it should. The CEL rules and the
API server's refusal of unknown fields need a real API server: e2e/tests/test_crd.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from fleet_samples import SCHEMA
from rolloutfleet_operator.fleet import MAX_FLEET_NAME_LENGTH
from rolloutfleet_proxy.reasoning_parsers import REASONING_PARSER_NAMES
from rolloutfleet_proxy.tool_parsers import TOOL_CALL_PARSER_NAMES
from rolloutfleet_testkit import crdgen, fleet_setup

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "rolloutfleets.rolloutfleet.dev.yaml"
SAMPLES = ROOT / "operator" / "samples"
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
    # From Kubernetes' types: quantities and int-or-string, atomic maps.
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-map-type",
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


def test_the_crd_files_are_generated_from_the_source_and_current():
    files = crdgen.generated_files()
    assert set(files) == {*crdgen.TARGETS, crdgen.DEFAULTS_MODULE}
    assert not crdgen.stale_targets(files), "run ./dev crd"
    crd = yaml.safe_load(files[crdgen.TARGETS[0]])
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    # Kubernetes' types are filled in (a few fields that tell the real schema from a free-form one).
    assert spec["proxy"]["properties"]["resources"]["properties"]["limits"]["additionalProperties"] == (
        crdgen.INT_OR_STRING
    )
    toleration = spec["engines"]["properties"]["tolerations"]["items"]["properties"]
    assert {"key", "operator", "value", "effect", "tolerationSeconds"} <= set(toleration)
    volume = spec["proxy"]["properties"]["tokenizer"]["properties"]["volume"]
    assert "name" not in volume["properties"] and "persistentVolumeClaim" in volume["properties"]
    assert "name" in spec["engines"]["properties"]["volumes"]["items"]["required"]
    # kubectl apply (client-side) keeps the whole object in a 256 KiB annotation.
    assert len(json.dumps(crd, separators=(",", ":"))) < 200_000


def test_kubernetes_types_become_structural_schemas():
    schemas = {
        "A": {
            "description": "d",
            "type": "object",
            "properties": {"b": {"allOf": [{"$ref": "#/x/B"}], "default": {}}},
        },
        "B": {
            "type": "object",
            "required": ["k"],
            "properties": {
                "k": {"type": "string", "description": "nested: dropped"},
                "q": {"$ref": "#/x/Q"},
                "m": {
                    "type": "array",
                    "items": {"type": "string"},
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["k"],
                    "x-kubernetes-patch-strategy": "merge",
                },
                "free": {"type": "object"},
                "port": {"type": "integer", "format": "int32"},
                "name": {"type": "string", "format": "hostname-ish"},
            },
        },
        "Q": {"oneOf": [{"type": "string"}, {"type": "number"}]},
        "R": {"type": "object", "properties": {"r": {"$ref": "#/x/R"}}},
    }
    assert crdgen.structural("A", schemas) == {
        "type": "object",
        "properties": {
            "b": {
                "type": "object",
                "required": ["k"],
                "properties": {
                    "k": {"type": "string"},
                    "q": crdgen.INT_OR_STRING,
                    "m": {"type": "array", "items": {"type": "string"}},
                    "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                    "port": {"type": "integer", "format": "int32"},
                    "name": {"type": "string"},
                },
            }
        },
    }
    with pytest.raises(ValueError, match="recursive"):
        crdgen.structural("R", schemas)
    source = {
        "x-shared": {},
        "spec": {"f": {"x-kubernetes-schema": "B", "x-kubernetes-schema-omit": ["k"], "description": "ours"}},
    }
    expanded = crdgen.expand(crdgen.without_shared_blocks(source), schemas)
    assert expanded["spec"]["f"]["description"] == "ours"
    assert "k" not in expanded["spec"]["f"]["properties"] and "required" not in expanded["spec"]["f"]
    assert "x-shared" not in expanded


def test_the_defaults_module_holds_the_sources_defaults():
    source = {
        "spec": {
            "versions": [
                {
                    "schema": {
                        "openAPIV3Schema": {
                            "properties": {
                                "spec": {
                                    "properties": {
                                        "proxy": {
                                            "default": {},
                                            "properties": {
                                                "stalenessTimeoutSeconds": {
                                                    "type": "number",
                                                    "default": 1800,
                                                },
                                                "dryRun": {"type": "boolean", "default": False},
                                                "policy": {"type": "string", "default": "manual"},
                                                "image": {"type": "string"},
                                            },
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            ]
        }
    }
    namespace: dict[str, Any] = {}
    exec(crdgen.defaults_module(source), namespace)
    assert namespace["SPEC_DEFAULTS"] == {
        "proxy.stalenessTimeoutSeconds": 1800,
        "proxy.dryRun": False,
        "proxy.policy": "manual",
    }
    # As the CRD writes it: the operator puts it in pod templates as it is (1800, not 1800.0).
    assert type(namespace["PROXY_STALENESS_TIMEOUT_SECONDS"]) is int
    assert namespace["PROXY_DRY_RUN"] is False and namespace["PROXY_POLICY"] == "manual"


def test_a_stale_or_missing_generated_file_is_reported(tmp_path):
    current, stale, missing = tmp_path / "current.py", tmp_path / "stale.py", tmp_path / "missing.py"
    current.write_text("A = 1\n")
    stale.write_text("A = 1\n")
    files = {current: "A = 1\n", stale: "A = 2\n", missing: "A = 1\n"}
    assert crdgen.stale_targets(files) == [stale, missing]


def test_the_name_rule_is_the_operators_limit():
    rules = [
        r["rule"]
        for r in yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
            "x-kubernetes-validations"
        ]
    ]
    assert f"self.metadata.name.size() <= {MAX_FLEET_NAME_LENGTH}" in rules
    assert MAX_FLEET_NAME_LENGTH + len("-proxy-999") == 63


def test_every_field_has_a_description_for_kubectl_explain():
    # The source: Kubernetes' types are leaves there (their own fields are Kubernetes' to document).
    root = crdgen.source_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    undocumented = [
        path
        for section in ("spec", "status")
        for path, node in schema_nodes(root["properties"][section], section)
        if path.rsplit(".", 1)[-1] not in ("[]", "{}")
        and not path.endswith(("[]", "{}"))
        and not node.get("description")
    ]
    assert not undocumented, f"fields kubectl explain would show without a description: {undocumented}"


# --- what the schema accepts and rejects -----------------------------------------------------------


def validator() -> jsonschema.Draft4Validator:
    """The schema as JSON Schema: Kubernetes' OpenAPI v3 subset reads like draft 4 (a boolean
    exclusiveMinimum); the x-kubernetes-* extensions are not JSON Schema and are ignored here."""
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def fleet(**proxy: Any) -> dict[str, Any]:
    return {
        "apiVersion": "rolloutfleet.dev/v1alpha1",
        "kind": "RolloutFleet",
        "metadata": {"name": "f"},
        "spec": {"proxy": {"tokenizer": {"path": "/t"}, **proxy}, "externalEngineUrls": ["http://e:1"]},
    }


def errors(obj: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator().iter_errors(obj)]


@pytest.mark.parametrize("name", sorted(p.name for p in SAMPLES.glob("*.yaml")))
def test_the_samples_are_valid(name):
    assert not errors(yaml.safe_load((SAMPLES / name).read_text()))


def test_the_test_kits_fleets_are_valid(tmp_path):
    """The fleets the e2e suite applies (rolloutfleet_testkit.fleet_setup) pass the CRD's schema."""
    external = fleet_setup.external_fleet("f", "ns", "/models/t", "http://10.0.0.1:9", 2)
    standin = fleet_setup.standin_fleet(
        "s",
        "ns",
        "/models/t",
        "http://10.0.0.1:9",
        3,
        tmp_path / "dumps",
        rss_bytes=50 << 20,
        drain_s=1.5,
        memory={"rssBudgetBytes": 64 << 20, "checkIntervalSeconds": 1},
    )
    assert not errors(external) and not errors(standin)
    env = {item["name"]: item["value"] for item in standin["spec"]["proxy"]["env"]}
    assert env == {
        "TESTKIT_PROGRAM": "stats-standin",
        "STANDIN_DRAIN_S": "1.5",
        "STANDIN_RSS_BYTES": str(50 << 20),
    }
    assert standin["spec"]["proxy"]["memory"]["rssBudgetBytes"] == 64 << 20
    assert (tmp_path / "dumps").stat().st_mode & 0o777 == 0o777  # pods run as uid 65532


ACCEPTED = {
    "no chat formats": {},
    "qwen": {"toolCallParser": "qwen25", "reasoningParser": "qwen3"},
    "deepseek": {"toolCallParser": "deepseekv3", "reasoningParser": "deepseek-r1"},
    "glm": {"toolCallParser": "glm45", "reasoningParser": "glm45"},
    "kimi": {"toolCallParser": "kimi_k2", "reasoningParser": "kimi"},
    "gpt-oss, thinking qwen": {"toolCallParser": "gpt-oss", "reasoningParser": "qwen3-thinking"},
    "llama, no reasoning": {"toolCallParser": "llama3"},
    "keywords": {"chatTemplateKwargs": {"enable_thinking": False}},
    "nested keywords": {"chatTemplateKwargs": {"a": {"b": [1, "x", None]}, "n": 1.5}},
    "empty keywords": {"chatTemplateKwargs": {}},
}


@pytest.mark.parametrize("proxy", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_the_schema_accepts(proxy):
    assert not errors(fleet(**copy.deepcopy(proxy)))


REJECTED = {
    "unknown tool parser": ({"toolCallParser": "hermes"}, "spec.proxy.toolCallParser"),
    "a reasoning parser as tool parser": ({"toolCallParser": "qwen3"}, "spec.proxy.toolCallParser"),
    "tool parser in other case": ({"toolCallParser": "Qwen25"}, "spec.proxy.toolCallParser"),
    "empty tool parser": ({"toolCallParser": ""}, "spec.proxy.toolCallParser"),
    "unknown reasoning parser": ({"reasoningParser": "step3"}, "spec.proxy.reasoningParser"),
    "a tool parser as reasoning parser": ({"reasoningParser": "qwen25"}, "spec.proxy.reasoningParser"),
    "reasoning parser not a string": ({"reasoningParser": 3}, "spec.proxy.reasoningParser"),
    "keywords as a JSON string": (
        {"chatTemplateKwargs": '{"enable_thinking": false}'},
        "spec.proxy.chatTemplateKwargs",
    ),
    "keywords as a list": ({"chatTemplateKwargs": ["enable_thinking"]}, "spec.proxy.chatTemplateKwargs"),
}


@pytest.mark.parametrize(("proxy", "where"), REJECTED.values(), ids=REJECTED.keys())
def test_the_schema_rejects(proxy, where):
    found = errors(fleet(**proxy))
    assert found and all(error.startswith(f"{where}: ") for error in found), found


def proxy_schema(field: str) -> dict[str, Any]:
    return SCHEMA["properties"]["spec"]["properties"]["proxy"]["properties"][field]


def test_crd_parser_names_are_the_proxys_registries():
    """One source of truth: the CRD offers exactly the parsers the proxy has (SGLang's names)."""
    for field, registry in (
        ("toolCallParser", TOOL_CALL_PARSER_NAMES),
        ("reasoningParser", REASONING_PARSER_NAMES),
    ):
        enum = proxy_schema(field)["enum"]
        assert len(enum) == len(set(enum)) and set(enum) == set(registry), field
        assert proxy_schema(field)["type"] == "string" and "SGLang" in proxy_schema(field)["description"]
    kwargs = proxy_schema("chatTemplateKwargs")
    # Without it the API server would prune every key of the object (it declares no properties).
    assert kwargs["type"] == "object" and kwargs["x-kubernetes-preserve-unknown-fields"] is True


GATEWAY_ACCEPTED = {
    "assignment mode": {"assignmentMode": "min_group"},
    "retries": {
        "retries": {"maxRetries": 1, "initialBackoffMillis": 0, "backoffMultiplier": 2, "jitterFactor": 1}
    },
    "circuit breaker off": {"circuitBreaker": {"enabled": False}},
    "tracing by name": {"tracing": {"otlpEndpoint": "otel-collector.monitoring:4317"}},
    "tracing by address": {"tracing": {"otlpEndpoint": "10.0.0.7:4317"}},
    "no disruption": {"maxUnavailable": 0},
}


@pytest.mark.parametrize("gateway", GATEWAY_ACCEPTED.values(), ids=GATEWAY_ACCEPTED.keys())
def test_the_schema_accepts_gateway_settings(gateway):
    obj = fleet()
    obj["spec"]["gateway"] = gateway
    assert not errors(obj)


ENDPOINT = "spec.gateway.tracing.otlpEndpoint"
BREAKER = "spec.gateway.circuitBreaker"
GATEWAY_REJECTED = {
    "the router's default name": ({"assignmentMode": "minload"}, "spec.gateway.assignmentMode"),
    "no attempt": ({"retries": {"maxRetries": 0}}, "spec.gateway.retries.maxRetries"),
    "jitter over 1": ({"retries": {"jitterFactor": 1.5}}, "spec.gateway.retries.jitterFactor"),
    "shrinking backoff": ({"retries": {"backoffMultiplier": 0.5}}, "spec.gateway.retries.backoffMultiplier"),
    "zero threshold": (
        {"circuitBreaker": {"failureThreshold": 0}},
        "spec.gateway.circuitBreaker.failureThreshold",
    ),
    "endpoint as a URL": (
        {"tracing": {"otlpEndpoint": "http://otel:4317"}},
        "spec.gateway.tracing.otlpEndpoint",
    ),
    "endpoint without port": ({"tracing": {"otlpEndpoint": "otel"}}, "spec.gateway.tracing.otlpEndpoint"),
    "tracing without endpoint": ({"tracing": {}}, "spec.gateway.tracing"),
}


@pytest.mark.parametrize(("gateway", "where"), GATEWAY_REJECTED.values(), ids=GATEWAY_REJECTED.keys())
def test_the_schema_rejects_gateway_settings(gateway, where):
    obj = fleet()
    obj["spec"]["gateway"] = gateway
    found = errors(obj)
    assert found and all(error.startswith(f"{where}: ") for error in found), found

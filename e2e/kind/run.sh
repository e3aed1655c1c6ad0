#!/usr/bin/env bash
# The e2e suite on kind, for hosts with a Docker engine (the project's own machines have none, so
# this path is not exercised in CI there). Usage: e2e/kind/run.sh [pytest args]
# The images are built from the same Dockerfiles (images/) the local cluster builds without Docker.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NAME="${KIND_CLUSTER:-rolloutfleet-e2e}"
VERSION="$("$ROOT/dev" version)"  # pyproject.toml, the one version source (docs/release.md)
cd "$ROOT"
# The directory kind-config.yaml mounts in every node: the tests' hostPath volumes live there.
SHARED=/tmp/rolloutfleet-kind
mkdir -p "$SHARED"
kind create cluster --name "$NAME" --config e2e/kind/kind-config.yaml
trap 'kind delete cluster --name "$NAME"' EXIT
# The suite talks to pods by their IPs, as on the local cluster: a route from this host (Linux,
# root) to each node's pod CIDR through the node's address on the kind network, removed at the end.
ROUTES=()
while read -r cidr address; do
  ip route replace "$cidr" via "$address" && ROUTES+=("$cidr")
done < <(kubectl get nodes -o jsonpath='{range .items[*]}{.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}')
trap 'for cidr in "${ROUTES[@]}"; do ip route del "$cidr" || true; done; kind delete cluster --name "$NAME"' EXIT
GPU_NODE="$(kubectl get nodes -l nvidia.com/gpu.present=true -o name | head -1)"
kubectl taint "$GPU_NODE" nvidia.com/gpu=present:NoSchedule --overwrite
# No GPU either: the GPU node advertises nvidia.com/gpu capacity through its status, as the local
# cluster's GPU node does.
kubectl patch "$GPU_NODE" --subresource=status --type=merge -p '{"status":{"capacity":{"nvidia.com/gpu":"8"}}}'
# The product's images, the test kit's (stand-ins and the real sglang-router) and the SGLang
# emulator's (a test stand-in for GPU SGLang servers, with torch).
for image in proxy operator testkit sglang-emulator; do
  DOCKER_BUILDKIT=1 docker build -f "images/$image/Dockerfile" --build-arg VERSION="$VERSION" -t "rolloutfleet-$image:$VERSION" .
done
# The operator's default gateway image, tagged with the sglang-router release it holds.
ROUTER_VERSION="$(sed -n 's/.*"sglang-router==\([^"]*\)".*/\1/p' pyproject.toml)"
DOCKER_BUILDKIT=1 docker build -f images/sglang-router/Dockerfile -t "rolloutfleet-sglang-router:$ROUTER_VERSION" .
docker pull busybox:1.36
kind load docker-image --name "$NAME" "rolloutfleet-proxy:$VERSION" "rolloutfleet-operator:$VERSION" \
  "rolloutfleet-testkit:$VERSION" "rolloutfleet-sglang-emulator:$VERSION" \
  "rolloutfleet-sglang-router:$ROUTER_VERSION" busybox:1.36
export KUBECONFIG="$(mktemp)"
kind get kubeconfig --name "$NAME" > "$KUBECONFIG"
# Servers the tests run on this host for pods (engine stand-ins) bind the kind network's gateway.
export ROLLOUTFLEET_HOST_IP="$(docker network inspect kind -f '{{(index .IPAM.Config 0).Gateway}}')"
export ROLLOUTFLEET_KIND_SHARED="$SHARED"
./dev test e2e/tests -m e2e --basetemp="$SHARED/pytest" "$@"

#!/usr/bin/env bash
# The e2e suite on kind, for hosts with a Docker engine (the project's own machines have none, so
# this path is not exercised in CI there). Usage: e2e/kind/run.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NAME="${KIND_CLUSTER:-rolloutfleet-e2e}"
cd "$ROOT"
kind create cluster --name "$NAME" --config e2e/kind/kind-config.yaml
trap 'kind delete cluster --name "$NAME"' EXIT
GPU_NODE="$(kubectl get nodes -l nvidia.com/gpu.present=true -o name | head -1)"
kubectl taint "$GPU_NODE" nvidia.com/gpu=present:NoSchedule --overwrite
docker build -f e2e/kind/Dockerfile.proxy -t rolloutfleet-proxy:e2e .
docker build -f e2e/kind/Dockerfile.refengine -t rolloutfleet-refengine:e2e .
docker build -f e2e/kind/Dockerfile.operator -t rolloutfleet-operator:0.1.0 .
kind load docker-image --name "$NAME" rolloutfleet-proxy:e2e rolloutfleet-refengine:e2e rolloutfleet-operator:0.1.0
export KUBECONFIG="$(mktemp)"
kind get kubeconfig --name "$NAME" > "$KUBECONFIG"
./dev test tests/e2e -m e2e "$@"

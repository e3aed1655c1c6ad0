"""Pure builders of the fleet's child objects: a Fleet in, Kubernetes manifests (dicts) out, one
module per object as KubeRay's `common/` has them.

- `metadata`: owner references, object metadata, pod labels (the names and labels themselves are
  the fleet's, in `rolloutfleet_operator.fleet`);
- `pods`: what the pods of every component share (placement, probes, security contexts, env
  overrides) and the Deployments and PodDisruptionBudgets around them;
- `proxy_env`: the proxy settings the operator injects as environment variables;
- `proxy_pod`: one proxy pod and its template hash;
- `proxy_services`: the proxies' headless and client Services;
- `admin_key`: the generated admin-key Secret;
- `gateway`: the SGLang router Deployment, its RBAC and Service;
- `engines`: the SGLang engine Deployment and its headless Service;
- `network_policies`: the fleet's NetworkPolicies;
- `children`: every child the fleet wants (but proxy pods and the admin-key Secret), and those it
  no longer wants.

Every child carries the fleet's labels for its component and a controller ownerReference to the
fleet, so garbage collection removes it with the fleet. Proxy pods are built one at a time
(`proxy_pod.proxy_pod`) because the reconciler creates, replaces and deletes them individually under
stable names; everything else comes from `children.desired_children`. The admin-key Secret is built
on its own: its value is random, so it is created once and never re-applied.

Servers bind the wildcard address (`0.0.0.0`), as containers normally do: each pod has its own
network namespace, and a wildcard bind also answers `kubectl port-forward` (which connects to the
pod's loopback), unlike a bind to the pod's own IP.
"""

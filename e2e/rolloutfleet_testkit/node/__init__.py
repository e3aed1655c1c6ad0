"""A real local Kubernetes for the tests and the demo: the control plane plus real kubelets with
containerd (see cluster.py)."""

from .cluster import RealCluster, real_cluster

__all__ = ["RealCluster", "real_cluster"]

"""The process kubelet: a TEST HARNESS that makes a Kubernetes control plane run pods as local processes.

It registers a CPU node (`rf-cpu-node`) and a GPU node (`rf-gpu-node`, four `nvidia.com/gpu`, tainted
NoSchedule) and runs every pod bound to them: each pod gets its own 127.0.x.y address, each container
is a process with its real command, args and environment (images map to local programs, see
images.py), volumes are host directories bind-mounted at their mountPaths, probes and restart
policies behave as a kubelet's, graceful deletion sends SIGTERM and honours the grace period, and
pod status is reported the way a kubelet reports it. It stands in for kubelets where no container
runtime exists; it is not a container runtime (no isolation beyond a private mount namespace, no
images, no `kubectl logs/exec` — logs are files under the state dir, one per container).

    python -m rolloutfleet_testkit.kubelet --kubeconfig PATH --state-dir DIR
    ProcessKubelet(kubeconfig, state_dir).start() ... .stop()
"""

from .kubelet import ProcessKubelet
from .nodes import CPU_NODE, GPU_NODE

__all__ = ["CPU_NODE", "GPU_NODE", "ProcessKubelet"]

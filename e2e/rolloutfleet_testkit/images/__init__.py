"""Container images built on this machine from the project's Dockerfiles (no registry is reachable)
and imported into the nodes' containerd: `ensure_images(names, containerd_addresses)`."""

from .catalog import ensure_images

__all__ = ["ensure_images"]

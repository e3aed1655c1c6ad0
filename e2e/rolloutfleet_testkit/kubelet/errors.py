"""Errors that keep a container from starting; their `reason` is what the container's waiting state shows."""

from __future__ import annotations


class ContainerStartError(Exception):
    """The container cannot start yet; the kubelet retries (the condition may resolve, e.g. a Secret
    being created later), showing `reason` and the message in the container's waiting state."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def config_error(message: str) -> ContainerStartError:
    return ContainerStartError("CreateContainerConfigError", message)


def mount_error(message: str) -> ContainerStartError:
    # A real kubelet leaves such containers in ContainerCreating and reports FailedMount events.
    return ContainerStartError("ContainerCreating", message)


def image_error(message: str) -> ContainerStartError:
    # Like ErrImagePull: the image has no command this host can run (see images.py).
    return ContainerStartError("ImageNotRunnable", message)

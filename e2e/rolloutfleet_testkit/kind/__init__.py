"""kind clusters on this machine type: Docker from Debian (with a runtime wrapper for a missing
capability), kind from the Go module proxy, a node image built here from the binaries the test kit
already builds, a CNI of our own (no kindnetd: it cannot be built from the Go module proxy), and a
teardown that puts back every host setting Docker and the privileged nodes changed."""

"""What the proxy, the operator and the clients agree on: the wire formats (a session's record, the
export batch), the error codes, and the settings the operator injects into proxies.

It imports no other RolloutFleet package (the import-layer check holds it to that); each module
imports only what its format needs (the operator imports no numpy through it).
"""

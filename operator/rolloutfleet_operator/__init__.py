"""The RolloutFleet operator: reconciles RolloutFleet resources into proxies, the gateway and engines."""

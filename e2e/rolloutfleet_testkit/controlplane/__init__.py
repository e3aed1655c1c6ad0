"""A real local Kubernetes control plane, built from the Go module proxy (test harness)."""

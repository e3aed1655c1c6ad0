"""The operator's Prometheus metrics, served on --metrics-port (/metrics).

Per-proxy numbers that change every few seconds (RSS) belong here and in Events, not in the
RolloutFleet object: writing them to status would make every watcher of the fleet wake up.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

FLEET = ("namespace", "fleet")

RECONCILE_SECONDS = Histogram(
    "rolloutfleet_operator_reconcile_duration_seconds",
    "Duration of one reconciliation pass of a fleet",
    FLEET,
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RECONCILE_ERRORS = Counter(
    "rolloutfleet_operator_reconcile_errors_total", "Reconciliation passes that raised", FLEET
)
CHILDREN_CREATED = Counter(
    "rolloutfleet_operator_children_created_total", "Objects created for fleets", (*FLEET, "kind")
)
PROXIES_DELETED = Counter(
    "rolloutfleet_operator_proxy_deletions_total",
    "Proxy pods deleted by the operator, by reason "
    "(Down, ScaleDown, ReplaceOutdated, RollingUpdate, MemoryBudget)",
    (*FLEET, "reason"),
)
FLEET_PROXIES = Gauge(
    "rolloutfleet_operator_fleet_proxies",
    "Proxy pods of a fleet by state (desired, ready, updated)",
    (*FLEET, "state"),
)
PROXY_RSS = Gauge(
    "rolloutfleet_operator_proxy_rss_bytes", "RSS each proxy last reported on /stats", (*FLEET, "pod")
)
PROXY_RSS_BUDGET = Gauge(
    "rolloutfleet_operator_proxy_rss_budget_bytes",
    "The fleet's proxy.memory.rssBudgetBytes (0: the memory watchdog is off), set each watchdog cycle",
    FLEET,
)
PROXIES_IN_BACKOFF = Gauge(
    "rolloutfleet_operator_proxies_in_memory_backoff",
    "Over-budget proxies the watchdog holds back in the cooldown of an earlier memory restart",
    FLEET,
)
FLEET_READY = Gauge(
    "rolloutfleet_operator_fleet_ready",
    "1 while the fleet's Ready condition is True, set by each pass",
    FLEET,
)
FLEET_AVAILABLE = Gauge(
    "rolloutfleet_operator_fleet_available",
    "1 while the fleet's Available condition is True (enough proxies serve), set by each pass",
    FLEET,
)
MEMORY_RESTARTS = Counter(
    "rolloutfleet_operator_memory_restarts_total",
    "Proxies restarted by the memory watchdog, by reason (OverBudget, DryRun for would-be restarts)",
    (*FLEET, "reason"),
)
POLL_FAILURES = Counter(
    "rolloutfleet_operator_stats_poll_failures_total",
    "Failed /stats polls of proxies, by reason",
    (*FLEET, "reason"),
)

WATCHDOG_CYCLES = Counter("rolloutfleet_operator_watchdog_cycles_total", "Memory watchdog cycles run", FLEET)
WATCHDOG_API_REQUESTS = Counter(
    "rolloutfleet_operator_watchdog_api_requests_total",
    "Kubernetes API requests made by the memory watchdog (per cycle: divide by the cycles)",
    FLEET,
)
WATCHDOG_POLLS = Counter(
    "rolloutfleet_operator_watchdog_polls_total", "Proxy /stats polls made by the memory watchdog", FLEET
)


def serve(port: int, address: str) -> int:
    """Start the /metrics server in a thread; returns the bound port (port 0 picks a free one)."""
    server, _thread = start_http_server(port, addr=address)
    return server.server_port

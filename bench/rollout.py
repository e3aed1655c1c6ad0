"""Rollout throughput across fleets of 1, 2 and 4 proxies, as a fraction of the Little's-law bound K/L.

The load is the example rollout (`rolloutfleet-rollout-example`, package `rolloutfleet_client`), run
as its own process: K concurrent sessions of T turns each (plus creation, a session reward, finish,
and at the end the export and acknowledgement of every trajectory with the trainer client), placed
least-loaded over N local proxy processes, each started with its own `--public-url` as the operator
does. Behind them the fixed-latency upstream stand-in answers every `/generate` after L seconds with
a tiny output. Sessions start at seeded random offsets within L (not in lockstep).

Throughput is turns per second as the sum over sessions of each session's turns over its own turn
phase (as `bench/overhead.py` measures it), compared with K/L; the wall-clock rate over the whole
turn phase is recorded too. Every process shares this machine's cores: the load generator, the
proxies and the stand-in. The CPU each used and the load average before and after each run are
recorded, since other work on the machine depresses the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
from common import (
    ADMIN_KEY,
    IMAGES,
    cpu_seconds,
    progress,
    proxy_args,
    save_figure,
    save_result,
    upstream_stub,
)
from rolloutfleet_testkit.processes import ServerProcess, free_port, python_module


@contextlib.contextmanager
def fleet(work: Path, size: int, upstream_url: str) -> Iterator[list[tuple[str, psutil.Process]]]:
    """`size` proxy processes, started at once, each with its own port, dump directory and public URL."""
    started: list[tuple[str, ServerProcess]] = []
    try:
        for _ in range(size):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            args = proxy_args(work, port, upstream_url, "--public-url", url)
            log = work / f"proxy-{port}.log"
            started.append((url, ServerProcess(args, log, env={"ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY})))
        for url, process in started:
            process.wait_ready(f"{url}/readyz", 120)
        yield [(url, psutil.Process(process.pid)) for url, process in started]
    finally:
        for _, process in started:
            process.terminate()


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_example(
    urls: list[str],
    sessions: int,
    turns: int,
    args: argparse.Namespace,
    tag: str,
    on_line: Callable[[str], None] = lambda _: None,
) -> dict:
    """The example rollout as a child process; its summary plus the CPU it used in all (it is the
    only child reaped during the run, so the growth of RUSAGE_CHILDREN is its own). `on_line` sees
    each output line as it comes."""
    command = python_module(
        "rolloutfleet_client.rollout_example",
        "--endpoints",
        *urls,
        "--sessions",
        str(sessions),
        "--turns",
        str(turns),
        "--max-tokens",
        str(args.output_tokens),
        "--stagger-s",
        str(args.latency_s),
        "--progress-interval-s",
        "5",
        "--log-level",
        "warning",
    )
    before = children_cpu_seconds()
    began = time.perf_counter()
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY},
    )
    killer = threading.Timer(args.run_timeout_s, child.kill)
    killer.start()
    lines = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line.rstrip("\n"))
            on_line(lines[-1])
            if not line.startswith("{"):
                progress(f"  {tag} | {line.rstrip()}")
        child.wait()
    finally:
        killer.cancel()
    wall = time.perf_counter() - began
    if not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"the example rollout exited with {child.returncode}:\n" + "\n".join(lines[-30:]))
    summary = json.loads(lines[-1])
    summary["process_wall_s"] = round(wall, 3)
    summary["process_cpu_s"] = round(children_cpu_seconds() - before, 2)
    summary["exit_code"] = child.returncode
    return summary


def measure(
    urls_and_processes: list[tuple[str, psutil.Process]],
    stub: psutil.Process,
    sessions: int,
    args: argparse.Namespace,
    tag: str,
) -> dict:
    proxies = [p for _, p in urls_and_processes]
    urls = [u for u, _ in urls_and_processes]
    marks: dict[str, tuple[float, list[float], float, tuple[float, ...]]] = {}

    def mark(line: str) -> None:
        # The example prints "rollout: M sessions x T ..." as it starts and "rollout: done" when the
        # sessions are over (before the export): the window the proxies' CPU is taken over.
        if line.startswith("rollout: "):
            name = "end" if line.startswith("rollout: done") else "start"
            marks[name] = (
                time.perf_counter(),
                [cpu_seconds(p) for p in proxies],
                cpu_seconds(stub),
                os.getloadavg(),
            )

    summary = run_example(urls, sessions, args.turns, args, tag, mark)
    (t0, proxies0, stub0, load0), (t1, proxies1, stub1, load1) = marks["start"], marks["end"]
    window = t1 - t0
    proxy_used = [b - a for a, b in zip(proxies0, proxies1, strict=True)]
    generator_used = summary["rollout_cpu_s"]
    turns = max(1, summary["turns"])
    bound = sessions / args.latency_s
    return {
        "throughput_rps": summary["loop_turns_per_s"],
        "fraction_of_bound": round(summary["loop_turns_per_s"] / bound, 3),
        "wall_clock_rps": summary["turns_per_s"],
        "wall_fraction_of_bound": round((summary["turns_per_s"] or 0) / bound, 3),
        "turns": summary["turns"],
        "failures": summary["failures"],
        "latency_p50_ms": summary["turn_latency_p50_ms"],
        "latency_p99_ms": summary["turn_latency_p99_ms"],
        "sessions_per_proxy": sorted(summary["sessions_per_proxy"].values()),
        "trajectories_exported": summary.get("trajectories_exported"),
        "rollout_s": summary["elapsed_s"],
        "turn_phase_s": summary["turn_phase_s"],
        "export_s": summary.get("export_s"),
        "cpu_seconds": {
            "load_generator": generator_used,
            "load_generator_process_total": summary["process_cpu_s"],  # with start-up and export
            "proxies": round(sum(proxy_used), 2),
            "upstream_stub": round(stub1 - stub0, 2),
        },
        "cpu_cores_used": {
            "load_generator": round(generator_used / summary["elapsed_s"], 2),
            "proxies": round(sum(proxy_used) / window, 2),
            "per_proxy": [round(u / window, 2) for u in proxy_used],
            "upstream_stub": round((stub1 - stub0) / window, 2),
        },
        "load_generator_cpu_us_per_turn": round(generator_used / turns * 1e6),
        "proxy_cpu_us_per_turn": round(sum(proxy_used) / turns * 1e6),
        "load_average_before": [round(x, 2) for x in load0],
        "load_average_after": [round(x, 2) for x in load1],
    }


def point(
    members: list[tuple[str, psutil.Process]],
    stub: psutil.Process,
    size: int,
    k: int,
    args: argparse.Namespace,
) -> dict:
    """One (N proxies, K sessions) point: `--repeat` runs, the median one reported, all recorded."""
    samples = []
    for i in range(args.repeat):
        tag = f"N={size} K={k} #{i + 1}"
        progress(f"{tag}: {k} sessions x {args.turns} turns, L = {args.latency_s} s")
        sample = measure(members, stub, k, args, tag)
        progress(
            f"{tag}: {sample['throughput_rps']} turns/s = {sample['fraction_of_bound']} of K/L; "
            f"p50 {sample['latency_p50_ms']} ms, p99 {sample['latency_p99_ms']} ms; "
            f"cores {sample['cpu_cores_used']}; failures {sample['failures']}; "
            f"load {sample['load_average_after'][0]}"
        )
        samples.append(sample)
    fractions = [s["fraction_of_bound"] for s in samples]
    median = sorted(samples, key=lambda s: s["fraction_of_bound"])[len(samples) // 2]
    return {
        "proxies": size,
        "sessions": k,
        "turns": args.turns,
        "upstream_latency_s": args.latency_s,
        "output_tokens": args.output_tokens,
        "littles_law_bound_rps": k / args.latency_s,
        **median,
        "fraction_of_bound_samples": fractions,
        "fraction_of_bound_spread": round(statistics.pstdev(fractions), 3),
        "samples": samples,
    }


def plot(runs: list[dict], path: Path, latency_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for k in sorted({r["sessions"] for r in runs}):
        mine = [r for r in runs if r["sessions"] == k]
        left.plot(
            [r["proxies"] for r in mine],
            [r["fraction_of_bound"] for r in mine],
            marker="o",
            label=f"K = {k} (bound {k / latency_s:.0f} turns/s)",
        )
    left.set_xticks(sorted({r["proxies"] for r in runs}))
    left.set_xlabel("proxies in the fleet")
    left.set_ylabel("throughput / (K / L)")
    left.set_ylim(0, 1.05)
    left.legend(loc="lower left")
    left.set_title(f"Example rollout vs Little's-law bound (L = {latency_s} s)")
    labels = [f"N={r['proxies']}\nK={r['sessions']}" for r in runs]
    x = range(len(runs))
    bottom = [0.0] * len(runs)
    for role, name in (
        ("load_generator", "load generator"),
        ("proxies", "proxies"),
        ("upstream_stub", "stand-in"),
    ):
        values = [r["cpu_cores_used"][role] for r in runs]
        right.bar(list(x), values, 0.6, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.axhline(os.cpu_count() or 2, color="k", linestyle="--", linewidth=1, label="cores on this machine")
    right.set_xticks(list(x), labels)
    right.set_ylim(0, (os.cpu_count() or 2) * 1.3)
    right.set_ylabel("CPU cores used (mean over the run)")
    right.set_title("Where the CPU went")
    right.legend(loc="upper left", fontsize="small", ncol=2)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxies", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sessions", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--latency-s", type=float, default=0.2)
    parser.add_argument("--output-tokens", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="runs per point; the median is reported")
    parser.add_argument("--run-timeout-s", type=float, default=300.0)
    parser.add_argument("--work-dir", type=Path, help="keep logs here (default: a temporary directory)")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    progress(f"load average at start: {load_at_start[0]:.2f} {load_at_start[1]:.2f} {load_at_start[2]:.2f}")
    if load_at_start[0] > 0.5:
        progress("warning: the machine is not idle; other work depresses these numbers")
    runs = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-rollout-") as tmp:
        work = args.work_dir or Path(tmp)
        with upstream_stub(work, args.latency_s, args.output_tokens) as (stub_url, stub):
            for size in args.proxies:
                progress(f"fleet of {size}: starting {size} proxy process(es)")
                with fleet(work, size, stub_url) as members:
                    run_example([u for u, _ in members], 16, 2, args, f"N={size} warm-up")
                    runs += [point(members, stub, size, k, args) for k in args.sessions]
    save_result(
        "rollout",
        {
            "load_average_at_start": [round(x, 2) for x in load_at_start],
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "python": sys.version.split()[0],
            "runs": runs,
        },
    )
    plot(runs, IMAGES / "rollout.png", args.latency_s)
    failures = sum(s["failures"] for r in runs for s in r["samples"])
    if failures:
        raise SystemExit(f"{failures} sessions failed")


if __name__ == "__main__":
    main()

"""Overhead before and after session trees: the overhead benchmark from two checkouts, alternately.

`--before DIR` is a checkout of the proxy before the tree change (commit 9c97200: `git worktree add
/work/wt-before 9c97200`). Each round runs, one after the other, that checkout's own
`./dev bench overhead --family F --sessions K... --rounds 1` (its code, its environment, linear
sessions: the only load it accepts) and then this checkout's, with `--workload linear branching`.
Each builds and runs from its own checkout, so the two proxies differ only by their code; they are
measured on the same machine minutes apart, before/after/before/after. The runs are gathered into
one result (`bench/results/overhead_trees.json`) and plot (`docs/img/overhead-trees.png`).

The before checkout's own `bench/results/overhead-<family>.json` and plot are overwritten by its
runs (it is a throwaway worktree); this checkout's per-round file is removed once read (or put back
as it was, when it is a recorded result: `--workload linear` writes the overhead benchmark's own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import IMAGES, ROOT, progress, save_result
from overhead import plot

RUN_TIMEOUT_S = 1800  # one overhead run of a few K; far more than it takes


def clean_env() -> dict[str, str]:
    """The environment without this checkout's `./dev` settings, so the other `./dev` builds its own."""
    env = dict(os.environ)
    venv = env.pop("VIRTUAL_ENV", None)
    env.pop("ROLLOUTFLEET_PROXY_PYTHON", None)
    if venv:
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(venv))
    return env


def commit_of(checkout: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def run_overhead(checkout: Path, args: list[str], result_name: str) -> dict:
    """`./dev bench overhead ARGS` in `checkout`; its result file, read back."""
    command = [str(checkout / "dev"), "bench", "overhead", *args]
    progress(f"{checkout}: {' '.join(command[1:])}")
    subprocess.run(command, cwd=checkout, env=clean_env(), check=True, timeout=RUN_TIMEOUT_S)
    return json.loads((checkout / "bench" / "results" / f"{result_name}.json").read_text())


def summarize(runs: list[dict]) -> list[dict]:
    """Per K and series (code, workload): every round's fraction of K/L and added p50/p99, and the
    after/before ratio of the means for the same workload."""
    rows = []
    keys = list(dict.fromkeys((r["sessions"], r["code"], r["workload"]) for r in runs))
    for k, code, workload in keys:
        chosen = [r for r in runs if (r["sessions"], r["code"], r["workload"]) == (k, code, workload)]
        fractions = [r["proxy"]["fraction_of_bound"] for r in chosen]
        rows.append(
            {
                "sessions": k,
                "code": code,
                "workload": workload,
                "fraction_of_bound": fractions,
                "mean": round(sum(fractions) / len(fractions), 3),
                "added_latency_p50_ms": [r["added_latency_p50_ms"] for r in chosen],
                "added_latency_p99_ms": [r["added_latency_p99_ms"] for r in chosen],
                "proxy_cpu_us_per_turn": [r["proxy"]["proxy_cpu_us_per_turn"] for r in chosen],
                "direct_fraction_of_bound": [r["direct"]["fraction_of_bound"] for r in chosen],
                "load_average_1m_at_start": [r["load_average_1m_at_start"] for r in chosen],
            }
        )
    for row in rows:
        before = next((b for b in rows if b["sessions"] == row["sessions"] and b["code"] == "before"), None)
        if before is not None and row["code"] == "after":
            row["of_before_linear"] = round(row["mean"] / before["mean"], 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the proxy before trees")
    parser.add_argument("--rounds", type=int, default=2, help="before/after pairs")
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--sessions", nargs="+", default=["100", "400"])
    parser.add_argument("--workload", nargs="+", default=["linear", "branching"])
    parser.add_argument("--pause-s", type=float, default=30.0, help="idle time before each run")
    args = parser.parse_args()
    before, after = args.before.resolve(), ROOT
    common = ["--family", args.family, "--sessions", *args.sessions, "--rounds", "1"]
    family_suffix = "" if args.family == "test" else f"-{args.family}"
    after_name = f"overhead{family_suffix}" + "".join(f"-{w}" for w in args.workload)
    if args.workload == ["linear"]:
        after_name = f"overhead{family_suffix}"
    commits = {"before": commit_of(before), "after": commit_of(after)}
    progress(f"before: {before} ({commits['before']}), after: {after} ({commits['after']})")
    runs: list[dict] = []
    sides = []
    for round_ in range(args.rounds):
        for code, checkout, extra, name in (
            ("before", before, [], f"overhead{family_suffix}"),
            ("after", after, ["--workload", *args.workload], after_name),
        ):
            time.sleep(args.pause_s)
            load = os.getloadavg()
            leftovers = (ROOT / "bench" / "results" / f"{name}.json", IMAGES / f"{name}.png")
            kept = {path: path.read_bytes() for path in leftovers if code == "after" and path.exists()}
            result = run_overhead(checkout, [*common, *extra], name)
            sides.append({"round": round_, "code": code, "command": result["command"], "load_average": load})
            for run in result["runs"]:
                runs.append(
                    {
                        **run,
                        "round": round_,
                        "code": code,
                        "commit": commits[code],
                        "workload": run.get("workload", "linear"),
                        "load_average_1m_at_start": result["load_average_1m_at_start"],
                    }
                )
            if code == "after":  # this checkout's per-round files go; a recorded one is put back
                for leftover in leftovers:
                    if leftover in kept:
                        leftover.write_bytes(kept[leftover])
                    else:
                        leftover.unlink(missing_ok=True)
    summary = summarize(runs)
    for row in summary:
        progress(
            f"K={row['sessions']} {row['code']} {row['workload']}: {row['fraction_of_bound']} "
            f"mean {row['mean']}"
            + (f", {row['of_before_linear']} of before (linear)" if "of_before_linear" in row else "")
        )
    save_result(
        "overhead_trees",
        {
            "command": " ".join(["./dev", "bench", "overhead_trees", *sys.argv[1:]]),
            "commits": commits,
            "family": args.family,
            "runs_in_order": sides,
            "summary": summary,
            "runs": runs,
        },
    )
    plot(runs, IMAGES / "overhead-trees.png", name_of=lambda r: f"{r['code']} {r['commit']}, {r['workload']}")


if __name__ == "__main__":
    main()

"""The project's one version: `version` in pyproject.toml. Everything else follows it: the proxy's
`__version__` and the operator's default proxy image (package metadata), the images' tags and
labels (rolloutfleet_testkit.images.catalog), and the chart's `version` and `appVersion`, which
are written here (a test keeps them equal).

    ./dev version          print the version (and fail if the chart disagrees)
    ./dev version 0.2.0    set it in pyproject.toml and the chart
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
CHART = ROOT / "charts" / "rolloutfleet-operator" / "Chart.yaml"
# A release version that is also a valid image tag and chart version (SemVer without build
# metadata: an image tag cannot hold "+").
VERSION = re.compile(r"\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?")


def project_version(pyproject: str) -> str:
    return tomllib.loads(pyproject)["project"]["version"]


def with_project_version(pyproject: str, version: str) -> str:
    """pyproject.toml's text with [project] version set (the line only: the rest stays as written)."""
    start = pyproject.index("[project]")
    head, tail = pyproject[:start], pyproject[start:]
    tail, count = re.subn(r'(?m)^version = "[^"]*"$', f'version = "{version}"', tail, count=1)
    if count != 1:
        raise ValueError("pyproject.toml: no version line in [project]")
    return head + tail


def chart_versions(chart: str) -> tuple[str, str]:
    """(version, appVersion) of Chart.yaml's text."""
    found = dict(re.findall(r'(?m)^(version|appVersion): "?([^"\s]+)"?\s*$', chart))
    return found["version"], found["appVersion"]


def with_chart_version(chart: str, version: str) -> str:
    """Chart.yaml's text with version and appVersion set."""
    chart, versions = re.subn(r"(?m)^version: .*$", f"version: {version}", chart, count=1)
    chart, apps = re.subn(r"(?m)^appVersion: .*$", f'appVersion: "{version}"', chart, count=1)
    if (versions, apps) != (1, 1):
        raise ValueError("Chart.yaml: no version or appVersion line")
    return chart


def set_version(version: str, pyproject: Path = PYPROJECT, chart: Path = CHART) -> None:
    if not VERSION.fullmatch(version):
        raise ValueError(f"{version!r} is not a release version (MAJOR.MINOR.PATCH[-PRERELEASE])")
    pyproject.write_text(with_project_version(pyproject.read_text(), version))
    chart.write_text(with_chart_version(chart.read_text(), version))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Print or set the project's version (pyproject.toml and the chart)."
    )
    parser.add_argument("version", nargs="?", help="the new version, e.g. 0.2.0")
    args = parser.parse_args(argv)
    if args.version:
        set_version(args.version)
    version = project_version(PYPROJECT.read_text())
    chart = chart_versions(CHART.read_text())
    if chart != (version, version):
        print(f"Chart.yaml has version/appVersion {chart}, pyproject.toml {version}", file=sys.stderr)
        return 1
    print(version)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reading a Dockerfile (pure): instructions with their flags, exec or shell form, and variable
substitution, for the subset the project's Dockerfiles use (ARG, FROM, ENV, WORKDIR, COPY, RUN,
USER, ENTRYPOINT, CMD, EXPOSE, LABEL), with stages (`FROM … AS name`, `COPY --from=name`)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

KNOWN = {"ARG", "FROM", "ENV", "WORKDIR", "COPY", "RUN", "USER", "ENTRYPOINT", "CMD", "EXPOSE", "LABEL"}


class DockerfileError(ValueError):
    pass


@dataclass(frozen=True)
class Instruction:
    keyword: str
    text: str  # everything after the keyword and its flags, continuations joined
    flags: tuple[str, ...] = ()
    line: int = 0

    @property
    def exec_form(self) -> list[str] | None:
        """The JSON-array form (`["a", "b"]`), or None for the shell form."""
        if not self.text.startswith("["):
            return None
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None

    def flag(self, name: str) -> list[str]:
        return [f.split("=", 1)[1] for f in self.flags if f.startswith(f"--{name}=")]


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, line) with backslash continuations joined and comments dropped."""
    lines: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        # Comment and empty lines end nothing: Docker drops them, inside a continuation too.
        if stripped.startswith("#") or not stripped:
            continue
        if not current:
            start = number
        if stripped.endswith("\\"):
            current.append(stripped[:-1].rstrip())
            continue
        current.append(stripped)
        lines.append((start, " ".join(part for part in current if part)))
        current = []
    if current:
        lines.append((start, " ".join(part for part in current if part)))
    return lines


def parse(text: str) -> list[Instruction]:
    instructions = []
    for number, line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword not in KNOWN:
            raise DockerfileError(f"line {number}: unsupported instruction {keyword}")
        rest = rest.strip()
        flags = []
        while keyword in ("RUN", "COPY") and rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            flags.append(flag)
            rest = rest.strip()
        instructions.append(Instruction(keyword, rest, tuple(flags), number))
    if not any(i.keyword == "FROM" for i in instructions):
        raise DockerfileError("no FROM instruction")
    return instructions


def stage_source(text: str) -> tuple[str, str | None]:
    """`FROM image [AS name]` (after substitution): the image or earlier stage, and the stage's name
    (lower-cased: Docker matches stage names without case)."""
    words = text.split()
    if len(words) == 1:
        return words[0], None
    if len(words) == 3 and words[1].upper() == "AS":
        return words[0], words[2].lower()
    raise DockerfileError(f"FROM {text}: expected `FROM image [AS name]`")


_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


def substitute(text: str, variables: dict[str, str]) -> str:
    """$VAR, ${VAR}, ${VAR:-default} and ${VAR:+alternative}, as Docker expands them."""

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(4)
        value = variables.get(name, "")
        if match.group(2) == "-":
            return value or match.group(3)
        if match.group(2) == "+":
            return match.group(3) if value else ""
        return value

    return _VARIABLE.sub(replace, text)


def key_values(text: str) -> dict[str, str]:
    """`ENV`/`LABEL`/`ARG` arguments: `K=V K2="v 2"`, or the legacy `K V` form."""
    words = shlex.split(text)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    pairs = {}
    for word in words:
        key, sep, value = word.partition("=")
        pairs[key] = value if sep else ""
    return pairs


def cache_mounts(instruction: Instruction) -> dict[str, str]:
    """`RUN --mount=type=cache,target=…[,id=…]` (a build cache kept between builds): target → id
    (the target when no id is given, as BuildKit does)."""
    mounts = {}
    for mount in instruction.flag("mount"):
        options = dict(part.partition("=")[::2] for part in mount.split(","))
        if options.get("type") != "cache" or "target" not in options:
            raise DockerfileError(f"line {instruction.line}: only cache mounts are supported: {mount}")
        mounts[options["target"]] = options.get("id", options["target"])
    return mounts

"""`$(VAR)` expansion in env values, command, args and subPathExpr, by Kubernetes' rules.

- `$(NAME)` becomes NAME's value when NAME is defined, and stays `$(NAME)` verbatim when it is not
  (a misspelt reference is visible in the program's arguments instead of silently empty);
- `$$` is an escaped `$`: `$$(NAME)` becomes the literal `$(NAME)`;
- a `$` followed by anything else, a trailing `$` and an unclosed `$(` are kept as written.
Shell syntax (`$NAME`, `${NAME}`) is not touched: that is the shell's job inside the container.
"""

from __future__ import annotations

from collections.abc import Mapping


def expand(text: str, variables: Mapping[str, str]) -> str:
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char != "$" or i + 1 == n:
            out.append(char)
            i += 1
            continue
        following = text[i + 1]
        if following == "$":  # escaped operator
            out.append("$")
            i += 2
        elif following == "(":
            close = text.find(")", i + 2)
            if close == -1:  # unclosed reference: keep "$(" and scan on after it
                out.append("$(")
                i += 2
            else:
                name = text[i + 2 : close]
                out.append(variables.get(name, f"$({name})"))
                i = close + 1
        else:  # not a reference: keep both characters
            out.append("$" + following)
            i += 2
    return "".join(out)


def expand_all(items: list[str] | None, variables: Mapping[str, str]) -> list[str]:
    return [expand(str(item), variables) for item in items or []]

"""Pip's index settings as ``uv pip install`` options, one per line, for scripts/setup.sh.

scripts/setup.sh installs with uv, which reads neither pip's configuration files nor its ``PIP_*`` variables. So that
a machine's mirror, local wheel folders and constraint files apply as they do to ``pip install``, it passes on what
``pip config list`` prints (read from standard input): ``index-url``, ``extra-index-url``, ``find-links``,
``constraint`` and ``no-index``. pip's order of precedence holds: the ``install`` section over ``global``, the
environment (``:env:``) over both; other sections (``download``, ``freeze``, ...) are not an install's. A value
lists its items separated by whitespace, as pip splits them. Certificates are not options: uv reads ``SSL_CERT_FILE``.

Usage: ``pip config list | python scripts/uv_index_options.py``
"""

from __future__ import annotations

import ast
import sys

SECTION_RANK = {"global": 0, "install": 1, ":env:": 2}
LIST_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
                "constraint": "--constraint"}  # fmt: skip
TRUE = {"1", "true", "yes", "on"}


def uv_index_options(config_list: str) -> list[str]:
    """The uv options of ``config_list``, ``pip config list``'s output (``section.name='value'`` lines)."""
    settings: dict[str, tuple[int, str]] = {}
    for line in config_list.splitlines():
        key, equals, quoted = line.partition("=")
        section, dot, name = key.rpartition(".")
        if not equals or not dot or section not in SECTION_RANK:
            continue
        value = ast.literal_eval(quoted.strip())
        rank = SECTION_RANK[section]
        if name not in settings or rank >= settings[name][0]:
            settings[name] = (rank, str(value))
    options = []
    for name, flag in LIST_OPTIONS.items():
        if name in settings:
            options += [item for value in settings[name][1].split() for item in (flag, value)]
    if settings.get("no-index", (0, ""))[1].strip().lower() in TRUE:
        options.append("--no-index")
    return options


if __name__ == "__main__":
    for option in uv_index_options(sys.stdin.read()):
        print(option)

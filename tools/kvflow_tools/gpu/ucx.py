"""UCX's protocol tables (``UCX_PROTO_INFO=y``) read out of a child's stderr.

Why: which lane UCX picked for a put or a get (``cuda_ipc`` across processes, or a host or
staging lane) is the one thing only the GPU shows and only UCX's own log tells.  Phases E and
F keep every "remote memory" table and count the lanes; the children's log leaves the tables
out, as ucx.log already has them.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ("is_ucx_table", "ucx_summary", "ucx_tables")

UCX_PREFIX = re.compile(r"^\[[0-9.]+\]\s+\[([^\]]+)\]\s+")  # "[time] [host:pid:thread]  "


def ucx_tables(lines: list[str]) -> list[dict[str, Any]]:
    """The UCX_PROTO_INFO tables in a log: context line, operation line, then (range, how, lane)
    rows; a table's lines are told apart by their [host:pid:thread], as threads may interleave.
    Never raises."""
    tables: list[dict[str, Any]] = []
    current: dict[str, dict[str, Any]] = {}  # by [host:pid:thread]
    for ln in lines:
        m = UCX_PREFIX.match(ln)
        body = ln[m.end() :].strip() if m else ""
        if not m or not body.startswith("|"):
            continue
        cells = [c.strip() for c in body.strip("|").split("|")]
        table = current.get(m.group(1))
        if len(cells) == 1:
            if table is not None and not table["operation"]:
                table["operation"] = cells[0]
            else:
                table = current[m.group(1)] = {"context": cells[0], "operation": "", "rows": []}
                tables.append(table)
        elif table is not None and cells[0] != "Range":
            table["rows"].append(cells)
    return tables


def ucx_summary(lines: list[str]) -> dict[str, Any]:
    """What UCX chose: every 'remote memory' table (NIXL's WRITE is a put, its READ a get), once
    each, and how often each lane (transport/device) appears in any table.  Never raises."""
    remote: list[str] = []
    lanes: dict[str, int] = {}
    for t in ucx_tables(lines):
        for row in t["rows"]:
            lanes[row[-1]] = lanes.get(row[-1], 0) + 1
        if "remote memory" in t["operation"]:
            text = f"{t['context']}: {t['operation']}: " + "; ".join(" ".join(r) for r in t["rows"])
            if text not in remote:
                remote.append(text)
    return {"remote_memory": remote, "lanes": lanes}


def is_ucx_table(line: str) -> bool:
    """Whether a log line is part of a UCX_PROTO_INFO table (a row or a rule).  Never raises."""
    m = UCX_PREFIX.match(line)
    return m is not None and line[m.end() :].lstrip().startswith(("|", "+"))

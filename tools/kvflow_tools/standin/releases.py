"""Where vLLM 0.33 and 0.34 differ for the stand-in's engine core and model runner.

Why one module: the stand-in plays vLLM's engine core and model runner around vLLM's own
scheduler and allocation, so it builds some of vLLM's own objects, whose fields change between
releases.  Each difference is absorbed here, by asking the installed vLLM what it has (never by
its version string), so that the rest of the stand-in reads as one release.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ("runner_output",)


def runner_output(output_class: type[Any], *, req_ids: list[str], **fields: Any) -> Any:
    """vLLM's `ModelRunnerOutput` for `req_ids`: 0.33 also wants each request's index
    (``req_id_to_index``), which 0.34 dropped (the order of ``req_ids`` says it)."""
    names = {f.name for f in dataclasses.fields(output_class)}
    if "req_id_to_index" in names:
        fields["req_id_to_index"] = {request_id: i for i, request_id in enumerate(req_ids)}
    return output_class(req_ids=req_ids, **fields)

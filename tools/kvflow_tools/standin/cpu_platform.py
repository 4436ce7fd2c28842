"""`StandInCpuPlatform`: vLLM's CPU platform without its refusal of a host without Triton.

Why: see `kvflow_tools.standin.platform`, the plugin that names it to vLLM.  vLLM imports this
module only once it has chosen the platform, as it imports its own.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.platforms.cpu import CpuPlatform

__all__ = ("StandInCpuPlatform",)

log = logging.getLogger(__name__)


class StandInCpuPlatform(CpuPlatform):
    """vLLM's CPU platform, with no refusal of a host without Triton."""

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        import vllm.triton_utils as triton_utils

        if triton_utils.HAS_TRITON:
            super().check_and_update_config(vllm_config)
            return
        log.warning("no Triton here: vLLM's CPU model runner could not run, and the stand-in does not need it")
        triton_utils.HAS_TRITON = True  # read by the check, at its call, from the module
        try:
            super().check_and_update_config(vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

"""TEST DOUBLE harness for subprocesses whose PYTHONPATH holds this folder.

With ``TORCH_NPU_DOUBLE_DEVICE_FILES`` set (a glob of fake /dev/davinciN files), the
Ascend probe looks there, so a whole ``chipset`` command (conformance, multi-rank
worlds) can select the ascend backend against the double. Unset: does nothing.
"""

import os

if os.environ.get("TORCH_NPU_DOUBLE_DEVICE_FILES"):
    import chipset_ascend

    chipset_ascend.DEVICE_FILES_GLOB = os.environ["TORCH_NPU_DOUBLE_DEVICE_FILES"]

"""TEST DOUBLE harness for subprocesses whose PYTHONPATH holds this folder.

With ``TORCH_NPU_DOUBLE_DEVICE_FILES`` set (a glob of fake /dev/davinciN files), the
Ascend probe looks there, so a whole ``chipset`` command (conformance, multi-rank
worlds) can select the ascend backend against the double. Unset: does nothing.
"""

import os

if os.environ.get("TORCH_NPU_DOUBLE_DEVICE_FILES"):
    try:
        import chipset_ascend
    except ImportError:  # an interpreter without chipset installed: nothing to point
        chipset_ascend = None
    if chipset_ascend is not None:
        chipset_ascend.DEVICE_FILES_GLOB = os.environ["TORCH_NPU_DOUBLE_DEVICE_FILES"]

"""Collectives over gloo, the CPU process-group backend of torch.distributed.

Everything is chipset's shared host collective (:class:`chipset.plugin_kit.host.HostCollective`):
core's ops over gloo, plus the integer ``avg`` gloo lacks on torch 2.13, done as a sum then an
integer division rounding toward zero.
"""

from __future__ import annotations

from chipset.plugin_kit.host import HostCollective


class CpuCollective(HostCollective):
    backend_name = "cpu"

"""Ascend NPUs as chipset devices, on ``torch.npu``: chipset-accelerator's generic device
(device calls, streams, events, RNG and dtypes by delegation to the device module) with
the Ascend differences: the module reached through torch_npu, the 910 profiles, spawn.

The runtime applies ``ASCEND_RT_VISIBLE_DEVICES`` itself (device indices here are
logical, 0..device_count()-1). torch_npu refuses to run in a process forked after
the NPU was initialised, so launchers must use the ``spawn`` start method
(:attr:`AscendDevice.start_method`).
"""

from __future__ import annotations

from chipset.interfaces import DeviceProperties
from chipset_accelerator.device import AcceleratorDevice
from chipset_ascend._runtime import DEVICE_TYPE, npu
from chipset_ascend.properties import profile_for_soc_name

VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"


class AscendDevice(AcceleratorDevice):
    backend_name = "ascend"
    device_type = DEVICE_TYPE
    visible_devices_env = VISIBLE_ENV
    start_method = "spawn"
    """Multiprocessing start method launchers must use: torch_npu refuses fork after init."""

    def __init__(self) -> None:
        super().__init__(DEVICE_TYPE)

    @property
    def module(self):
        """``torch.npu``, reached through torch_npu at call time (see ``chipset_ascend._runtime``)."""
        return npu()

    def _properties(self, index: int) -> DeviceProperties:
        props = npu().get_device_properties(index)
        name = str(getattr(props, "name", "") or npu().get_device_name(index))
        total = int(props.total_memory)
        known = profile_for_soc_name(name)
        cores = getattr(props, "cube_core_num", None)
        if known is None:
            # An Ascend part we have no data for: report what the runtime says, no rates.
            return DeviceProperties(
                name=name, index=index, total_memory=total, multiprocessor_count=cores,
                estimated=True, source=f"torch.npu.get_device_properties({index}); no chipset profile for {name!r}",
            )
        return DeviceProperties(
            name=name,
            index=index,
            total_memory=total,  # what the runtime lets us use, not the HBM size
            peak_flops=dict(known.peak_flops),
            memory_bandwidth=known.memory_bandwidth,
            intra_node_bandwidth=known.intra_node_bandwidth,
            inter_node_bandwidth=known.inter_node_bandwidth,
            intra_node_latency=known.intra_node_latency,
            inter_node_latency=known.inter_node_latency,
            multiprocessor_count=cores,
            estimated=known.estimated,
            source=f"memory: torch.npu.get_device_properties({index}); rates: {known.source}",
        )

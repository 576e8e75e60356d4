"""Plugin discovery and backend selection."""

from chipset.discovery.descriptor import BackendDescriptor
from chipset.discovery.hookspecs import hookimpl
from chipset.discovery.records import BackendRecord, ChipsetPluginWarning, discover
from chipset.discovery.select import Selection, select
from chipset.discovery.spec import BackendSpec

__all__ = ["BackendDescriptor", "BackendRecord", "BackendSpec", "ChipsetPluginWarning", "Selection", "discover", "hookimpl", "select"]

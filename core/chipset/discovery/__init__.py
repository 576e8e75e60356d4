"""Plugin discovery and backend selection."""

from chipset.discovery.descriptor import BackendDescriptor
from chipset.discovery.hookspecs import hookimpl
from chipset.discovery.records import BackendRecord, ChipsetPluginWarning, discover
from chipset.discovery.select import Selection, select

__all__ = ["BackendDescriptor", "BackendRecord", "ChipsetPluginWarning", "Selection", "discover", "hookimpl", "select"]

"""Intel Gaudi accelerators through the Habana device plugin."""

from hooks.runtime.vendors.base import VendorAdapter

ADAPTER = VendorAdapter(vendor="intel-gaudi", resource_name="habana.ai/gaudi", taint_key="habana.ai/gaudi")

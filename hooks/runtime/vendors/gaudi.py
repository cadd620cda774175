"""Intel Gaudi accelerators through the Habana device plugin.

Security: nothing to relax. The Habana container runtime injects devices and driver libraries;
host networking for scale-out (RoCE) is not used for single-node serving.
"""

from hooks.runtime.vendors.base import VendorAdapter

ADAPTER = VendorAdapter(vendor="intel-gaudi", resource_name="habana.ai/gaudi", taint_key="habana.ai/gaudi")

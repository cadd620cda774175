"""CPU only: no extended resource, no toleration.

Security: nothing to relax.
"""

from hooks.runtime.vendors.base import VendorAdapter

ADAPTER = VendorAdapter(vendor="none", resource_name=None)

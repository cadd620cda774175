"""AMD Instinct GPUs through the ROCm device plugin."""

from hooks.runtime.vendors.base import VendorAdapter

ADAPTER = VendorAdapter(vendor="amd", resource_name="amd.com/gpu", taint_key="amd.com/gpu")

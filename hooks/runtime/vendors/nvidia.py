"""NVIDIA GPUs through the NVIDIA device plugin (or GPU Operator)."""

from hooks.runtime.vendors.base import VendorAdapter

ADAPTER = VendorAdapter(vendor="nvidia", resource_name="nvidia.com/gpu", taint_key="nvidia.com/gpu")

"""NVIDIA GPUs through the NVIDIA device plugin (or GPU Operator).

Security: nothing to relax. The device plugin and the NVIDIA container runtime inject the device
nodes and driver libraries; the engine needs no capability and no host mount. (GPUDirect RDMA over
InfiniBand needs IPC_LOCK: add it in the runtime's `security.addCapabilities`; the namespace must
then be `privileged`, as `baseline` does not allow IPC_LOCK.)
"""

from hooks.runtime.vendors.base import VendorAdapter

ADAPTER = VendorAdapter(vendor="nvidia", resource_name="nvidia.com/gpu", taint_key="nvidia.com/gpu")

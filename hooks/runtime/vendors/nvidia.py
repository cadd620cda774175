"""NVIDIA GPUs through the NVIDIA device plugin (or GPU Operator).

Security: nothing to relax. The device plugin and the NVIDIA container runtime inject the device
nodes and driver libraries; the engine needs no capability and no host mount. (GPUDirect RDMA over
InfiniBand needs IPC_LOCK: add it in the runtime's `security.addCapabilities`; the namespace must
then be `privileged`, as `baseline` does not allow IPC_LOCK.)
"""

from hooks.runtime.vendors.base import VendorAdapter

# NVIDIA's own gpu-feature-discovery DaemonSet selects GPU nodes by the first two (Node Feature
# Discovery's PCI vendor 10de, the GPU Operator's label); GKE labels its GPU nodes with the third.
NODE_LABELS = (("feature.node.kubernetes.io/pci-10de.present", "true"), ("nvidia.com/gpu.present", "true"),
               ("cloud.google.com/gke-accelerator", None))

ADAPTER = VendorAdapter(vendor="nvidia", resource_name="nvidia.com/gpu", taint_key="nvidia.com/gpu",
                        node_labels=NODE_LABELS)

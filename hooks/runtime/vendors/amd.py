"""AMD Instinct GPUs through the ROCm device plugin.

Security: nothing to relax for serving. The device plugin passes /dev/kfd and /dev/dri; ROCm's own
docker examples add SYS_PTRACE and an unconfined seccomp profile for profiling and debugging tools
(rocprof, rocgdb), which a serving engine does not run. A runtime that needs them says so in
`security` (both leave `restricted`; SYS_PTRACE also leaves `baseline`).
"""

from hooks.runtime.vendors.base import VendorAdapter

# Node Feature Discovery's PCI vendor 1002 (AMD/ATI), and the AMD GPU Operator's node labeller.
NODE_LABELS = (("feature.node.kubernetes.io/pci-1002.present", "true"), ("amd.com/gpu.family", None))

ADAPTER = VendorAdapter(vendor="amd", resource_name="amd.com/gpu", taint_key="amd.com/gpu", node_labels=NODE_LABELS)

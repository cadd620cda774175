"""Huawei Ascend NPUs through the Ascend device plugin (Ascend 910 by default; override resourceName
for other models such as huawei.com/Ascend310P).

Security: nothing to relax when the Ascend Docker Runtime injects the driver (its usual setup).
Without it, vllm-ascend needs the host driver paths (/usr/local/Ascend/driver, /usr/local/dcmi,
npu-smi) mounted from the node: host mounts the runtime must declare, and which Pod Security
`baseline` refuses (hostPath), so such namespaces must be `privileged`.
"""

from hooks.runtime.vendors.base import VendorAdapter

ADAPTER = VendorAdapter(vendor="ascend", resource_name="huawei.com/Ascend910", taint_key="huawei.com/Ascend910")

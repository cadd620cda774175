"""Huawei Ascend NPUs through the Ascend device plugin (Ascend 910 by default; override resourceName
for other models such as huawei.com/Ascend310P)."""

from hooks.runtime.vendors.base import VendorAdapter

ADAPTER = VendorAdapter(vendor="ascend", resource_name="huawei.com/Ascend910", taint_key="huawei.com/Ascend910")

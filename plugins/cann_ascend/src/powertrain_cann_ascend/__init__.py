"""powertrain-cann-ascend: Huawei Ascend NPUs through torch_npu's fused CANN operators.

Importing this package (or its plugin module) never imports torch_npu: the platform
detection imports it when CANN is installed, and the backends' factories use it.
"""

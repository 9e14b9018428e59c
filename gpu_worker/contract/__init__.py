"""What the gateway and the device both know, in one place: the socket frames (`wire`), the one
error class (`errors`), ID and counter shapes (`ids`), limits, the API vocabulary and the device
commands with their actions (`vocabulary`), canonical operation bytes (`canonical`), the grant
file format (`grantfile`) and a blocking socket client (`client`).

The gateway imports nothing else from gpu_worker, and nothing here imports torch or Django.
"""

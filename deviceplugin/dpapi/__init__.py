"""The device-plugin API front-end: one gRPC server per resource name, registration with the
kubelet and its restart watch, the ListAndWatch feed, and pod-resources reconciliation.

It serves the GPUs the plan assigns to `api: device-plugin`; the DRA front-end (`deviceplugin.dra`)
serves the others. Both sit over the same core (inventory, plan, allocator, CDI, MPS, health).
"""

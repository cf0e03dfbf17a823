"""The DRA front-end: a kubelet DRA plugin, ResourceSlices and claims over the shared core.

A sibling of `deviceplugin.dpapi`: it serves the GPUs the plan gives `api: dra`, with the same
caps, CDI writer and MPS supervisor (DESIGN section 10).
"""

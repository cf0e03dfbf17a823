"""gpu-fraction-device-plugin: share NVIDIA GPUs between pods as memory slices.

Each GPU runs one sharing mode (time-slicing, sm-sharing over MPS, or exclusive) and is
advertised to the kubelet as slices of its memory, with caps that the driver or MPS enforce.
"""

__version__ = "0.1.0"

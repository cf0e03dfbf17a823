"""What the node has: NVML access, the GPU inventory, and what the last start saw.

`nvml` holds the one NVML session of the process (handles resolved once, keyed by UUID);
`gpus` reads the frozen inventory records and the node facts through it; `cache` keeps each
GPU's last record so a GPU lost across a restart keeps its slices. No policy lives here (the
plan decides what to advertise). Imports only `model` and `plumbing`.
"""

"""CDI: the specs this plugin writes, and the specs a node holds as a runtime reads them.

`specs` writes and validates our own specs (one file and one device per allocation or
prepared claim: caps and MPS variables, mounts, the toolkit's hooks); `registry` loads,
resolves and merges every spec of a node's spec directories (the driver's per-GPU devices
included) and watches them; `generated` makes the per-GPU driver devices the toolkit's spec
lacks (GPU Operator nodes) with the host's `nvidia-ctk cdi generate`. Imports only
`plumbing`.
"""

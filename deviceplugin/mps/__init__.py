"""MPS: the per-GPU control daemons behind sm-sharing slices.

`layout` owns the on-disk contract, `control` runs the control binary, `supervisor` starts,
adopts, probes and restarts the daemons.
"""

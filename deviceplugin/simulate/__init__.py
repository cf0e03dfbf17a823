"""Simulation: fake NVML, fake MPS control binary, presets and an embedded kubelet.

Used by `--simulate`, the demo and the tests; production code never imports it.
"""

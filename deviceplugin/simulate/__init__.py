"""Simulated GPU nodes: fake NVML, presets and spec files, driver CDI spec, fault injection.

Used by `--simulate`, the demo and the tests; the plugin's own code paths run unchanged on
top of it. Production code never imports this package.
"""

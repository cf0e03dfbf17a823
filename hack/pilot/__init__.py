"""The pilot: two inference services sharing one GPU versus one GPU each (DESIGN section 8).

`run.py` runs the seeded simulation and writes `report.md` with plots; `gpu.sh` runs the same
experiment on a real GPU under MPS with the caps the plugin's own allocator computes.
"""

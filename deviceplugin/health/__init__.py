"""Health by fault domain: Xid classes, NVML events, faults, the board, the state file.

`xid` says which domain an Xid or recovery action takes down; `events` is the NVML event
thread; `faults` keeps each GPU's fault records and recovery; `monitor` runs the event and
probe threads; `board` is where every producer (this monitor, the MPS supervisor, the
allocator) sets and clears faults and where both front-ends read device health; `state` is
the health file the CLI reads; `verdicts` bounds how long a domain not yet judged (an MPS
daemon's first bring-up) is kept from both front-ends. Imports `config`, `inventory`, `plan`,
`model` and `plumbing`; never MPS or a front-end (the MPS side sets its faults on the board
from above).
"""

"""The allocation ledger: every device-plugin allocation, kept across restarts and reboots.

`record` holds what one allocation records and its JSON lines; `store` is the ledger (a
snapshot plus a journal of changes since); `sync` makes its files durable off the reply
path; `replay` rewrites the CDI spec of every recorded allocation after a reboot empties the
CDI directory. Imports `cdi`, `model` and `plumbing`.
"""

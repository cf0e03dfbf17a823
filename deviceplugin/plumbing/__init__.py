"""What every part of the plugin uses and none owns: logs, careful files, processes, changes.

`logs` is the key=value logger; `fsutil` writes files other processes read (atomic, fsynced,
refusing symlinks); `process` tells whether a pid is alive; `updates` carries state changes
to asyncio streams; `afterreply` defers a gRPC handler's work until its reply is sent.
The bottom layer: imports nothing else of the plugin.
"""

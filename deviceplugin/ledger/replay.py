"""Answers the kubelet may replay: rewrite the CDI spec of every recorded allocation.

The kubelet replays a checkpointed Allocate answer for the pod's whole life, reboots
included, without calling Allocate again, and `/var/run/cdi` is a tmpfs; so at start,
before registering, each spec the ledger still holds is written again from its stored body.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.ledger.store import Ledger
from deviceplugin.plumbing import logs

LOG = logs.get("replay")


def restore_cdi_specs(ledger: Ledger, cdi_dir: Path) -> tuple[int, int]:
    """Write every recorded allocation's CDI spec into `cdi_dir`; (written, unrecoverable).

    A record from before bodies were kept cannot be rebuilt: it is logged, not guessed.
    """
    written = lost = 0
    for record in ledger.records():
        if record.cdi_spec is None:
            continue  # no spec of ours (plain env, or whole GPUs)
        if not record.cdi_body:
            lost += 1
            logs.log(LOG, "cdi spec cannot be rebuilt (record predates kept bodies)",
                     level=logging.WARNING, spec=record.cdi_spec)  # fmt: skip
            continue
        try:
            path = cdi_specs.write_spec(cdi_dir, record.cdi_body)
        except (cdi_specs.CdiError, OSError) as err:
            lost += 1
            logs.log(LOG, "cdi spec not restored", level=logging.WARNING,
                     spec=record.cdi_spec, error=str(err))  # fmt: skip
            continue
        written += 1
        if str(path) != record.cdi_spec:  # --cdi-dir changed: delete the new file when done
            ledger.add(replace(record, cdi_spec=str(path)))
    return written, lost

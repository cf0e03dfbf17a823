"""Verdicts: a device waits for its MPS daemon's first verdict, boundedly; an expired bound
is a verdict and asks for a republish."""

from __future__ import annotations

import threading

from deviceplugin.health.verdicts import Verdicts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_device_waits_until_judged_or_its_bound_expires() -> None:
    clock, expired = Clock(), threading.Event()
    verdicts = Verdicts(expired.set, bound=0.2, clock=clock)
    try:
        assert verdicts.waiting("gpu-1", unjudged=True)
        clock.now += 0.1
        assert verdicts.waiting("gpu-1", unjudged=True)
        assert not verdicts.waiting("gpu-0", unjudged=False)  # judged: never waits
        assert expired.wait(5.0)  # the bound's timer asks for a republish
        clock.now += 0.2
        assert not verdicts.waiting("gpu-1", unjudged=True)  # the expired bound is the verdict
        assert not verdicts.waiting("gpu-1", unjudged=False)
        assert verdicts.waiting("gpu-1", unjudged=True)  # unjudged again later: a fresh bound
    finally:
        verdicts.stop()

"""Ceiling resolution from the pod cache (DESIGN section 4, issue 7 item 4).

Allocate does not say which pod it serves, so the candidates are the containers of pods on
this node that request exactly `count` of the resource and hold no devices yet. One value,
or several that agree, wins; disagreement takes the lowest (an undeclared or invalid value
counts as "the request"), recorded as `ambiguous`. Pure: reads snapshots, never the network.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from deviceplugin.kube.pods import ContainerInfo, PodInfo
from deviceplugin.quantity import QuantityError, parse_quantity

CEILING_KEY = "nvidia.com/container.{container}.gpu-memory.limit"

# Sources recorded with each allocation.
ANNOTATION = "annotation"  # every candidate declared the same ceiling
NOT_DECLARED = "not-declared"  # candidates declare none: limit = request
AMBIGUOUS = "ambiguous"  # candidates disagree: the lowest applies
INVALID = "invalid"  # the candidate's value is not a quantity: limit = request
NO_CACHE = "no-cache"  # pod cache not synced (API server unreachable or integration off)
NO_CANDIDATES = "no-candidates"  # no waiting container asks for this many slices


@dataclass(frozen=True)
class Candidate:
    pod: PodInfo
    container: ContainerInfo

    @property
    def ceiling_key(self) -> str:
        return CEILING_KEY.format(container=self.container.name)


@dataclass(frozen=True)
class Invalid:
    candidate: Candidate
    value: str
    error: str


@dataclass(frozen=True)
class Resolution:
    limit: int | None  # bytes; None: the request
    source: str
    candidates: tuple[Candidate, ...] = ()
    invalid: tuple[Invalid, ...] = ()


def waiting(pod: PodInfo) -> bool:
    """A pod the kubelet may still be admitting (Allocate runs before any container starts)."""
    return not pod.deleting and pod.phase in ("", "Pending")


def candidates(
    pods: Iterable[PodInfo],
    resource: str,
    count: int,
    holding: Collection[tuple[str, str, str]],
) -> tuple[Candidate, ...]:
    """Containers requesting exactly `count` of `resource` that hold no devices yet.

    `holding` has (namespace, pod, container) of every container pod-resources or our own
    allocation records show with devices.
    """
    return tuple(
        Candidate(pod, c)
        for pod in pods
        if waiting(pod)
        for c in pod.containers
        if c.resources.get(resource) == count and (pod.namespace, pod.name, c.name) not in holding
    )


def declared(candidate: Candidate) -> int | Invalid | None:
    """The candidate's ceiling in bytes, None when it declares none, or why it is invalid."""
    raw = candidate.pod.annotations.get(candidate.ceiling_key)
    if raw is None:
        return None
    try:
        value = parse_quantity(raw)
    except QuantityError as err:
        return Invalid(candidate, raw, str(err))
    if value <= 0:
        return Invalid(candidate, raw, "must be greater than zero")
    return value


def resolve(found: tuple[Candidate, ...]) -> Resolution:
    if not found:
        return Resolution(None, NO_CANDIDATES)
    values: list[int | None] = []
    invalid: list[Invalid] = []
    for candidate in found:
        value = declared(candidate)
        if isinstance(value, Invalid):
            invalid.append(value)
            values.append(None)
        else:
            values.append(value)
    distinct = set(values)
    if len(distinct) > 1:
        # None (the request) sorts lowest: a ceiling is never below the request.
        numbers = [v for v in values if v is not None]
        lowest = None if None in distinct else min(numbers)
        return Resolution(lowest, AMBIGUOUS, found, tuple(invalid))
    (only,) = distinct
    if only is not None:
        return Resolution(only, ANNOTATION, found)
    return Resolution(None, INVALID if invalid else NOT_DECLARED, found, tuple(invalid))

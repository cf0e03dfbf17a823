"""Ceiling resolution (issue 7 item 4) as a pure function of cached pods."""

from __future__ import annotations

from collections.abc import Collection

from deviceplugin.dpapi import ceilings as ceil
from deviceplugin.kube.pods import PodInfo, pod_from_json
from deviceplugin.model import GIB, MIB
from deviceplugin.simulate.apiserver import pod

TS = "nvidia.com/gpu-fraction"
SM = "nvidia.com/gpu-fraction.sm-sharing"


def limit(container: str, value: str) -> dict[str, str]:
    return {f"nvidia.com/container.{container}.gpu-memory.limit": value}


def cached(*pods: dict[str, object]) -> list[PodInfo]:
    return [pod_from_json(p) for p in pods]


def resolve(
    pods: list[PodInfo],
    resource: str = TS,
    count: int = 2,
    holding: Collection[tuple[str, str, str]] = (),
) -> ceil.Resolution:
    return ceil.resolve(ceil.candidates(pods, resource, count, set(holding)))


def test_one_candidate_gets_its_ceiling() -> None:
    pods = cached(
        pod("a", {"app": {TS: 2}}, annotations=limit("app", "6Gi")),
        pod("b", {"app": {TS: 3}}, annotations=limit("app", "8Gi")),  # asks for 3, not 2
        pod("c", {"app": {SM: 2}}, annotations=limit("app", "8Gi")),  # other resource
    )
    got = resolve(pods)
    assert (got.limit, got.source) == (6 * GIB, ceil.ANNOTATION)
    assert [c.pod.name for c in got.candidates] == ["a"]


def test_agreeing_candidates_share_the_ceiling() -> None:
    pods = cached(
        pod("a", {"app": {TS: 2}}, annotations=limit("app", "3Gi")),
        pod("b", {"w": {TS: 2}}, annotations=limit("w", "3072Mi")),
    )
    got = resolve(pods)
    assert (got.limit, got.source) == (3 * GIB, ceil.ANNOTATION)


def test_disagreeing_candidates_get_the_lowest() -> None:
    pods = cached(
        pod("a", {"app": {TS: 2}}, annotations=limit("app", "5Gi")),
        pod("b", {"app": {TS: 2}}, annotations=limit("app", "2500Mi")),
        pod("c", {"app": {TS: 2}}, annotations=limit("app", "7Gi")),
    )
    got = resolve(pods)
    assert (got.limit, got.source) == (2500 * MIB, ceil.AMBIGUOUS)


def test_an_undeclared_candidate_pulls_the_ceiling_down_to_the_request() -> None:
    pods = cached(
        pod("a", {"app": {TS: 2}}, annotations=limit("app", "5Gi")), pod("b", {"x": {TS: 2}})
    )
    got = resolve(pods)
    assert (got.limit, got.source) == (None, ceil.AMBIGUOUS)


def test_no_candidates_and_no_declaration() -> None:
    assert resolve([]).source == ceil.NO_CANDIDATES
    got = resolve(cached(pod("a", {"app": {TS: 2}})))
    assert (got.limit, got.source) == (None, ceil.NOT_DECLARED)


def test_containers_holding_devices_and_finished_pods_are_not_candidates() -> None:
    pods = cached(
        pod("held", {"app": {TS: 2}}, annotations=limit("app", "3Gi")),
        pod("running", {"app": {TS: 2}}, phase="Running", annotations=limit("app", "4Gi")),
        pod("done", {"app": {TS: 2}}, phase="Succeeded", annotations=limit("app", "4Gi")),
        pod("new", {"app": {TS: 2}}, annotations=limit("app", "6Gi")),
    )
    got = resolve(pods, holding={("ns", "held", "app")})
    assert (got.limit, got.source) == (6 * GIB, ceil.ANNOTATION)


def test_init_containers_are_candidates_too() -> None:
    pods = cached(pod("a", {"app": {}}, init={"setup": {TS: 1}}, annotations=limit("setup", "2Gi")))
    got = resolve(pods, count=1)
    assert (got.limit, got.source) == (2 * GIB, ceil.ANNOTATION)
    assert got.candidates[0].container.init


def test_invalid_value_falls_back_to_the_request_and_is_reported() -> None:
    # 5,000 digits: past Python's int-from-text limit, refused by length (issue 33)
    for bad in ("lots", "-1Gi", "0", "1.5", "9" * 5000):
        got = resolve(cached(pod("a", {"app": {TS: 2}}, annotations=limit("app", bad))))
        assert (got.limit, got.source) == (None, ceil.INVALID), bad
        assert [i.value for i in got.invalid] == [bad]
    mixed = resolve(
        cached(
            pod("a", {"app": {TS: 2}}, annotations=limit("app", "lots")),
            pod("b", {"app": {TS: 2}}, annotations=limit("app", "4Gi")),
        )
    )
    assert (mixed.limit, mixed.source) == (None, ceil.AMBIGUOUS)
    assert len(mixed.invalid) == 1

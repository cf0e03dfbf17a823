"""key=value lines, and the work (lines, wake-ups) a gRPC handler leaves until its reply is sent."""

from __future__ import annotations

import asyncio
import logging

import pytest

from deviceplugin.plumbing import logs
from deviceplugin.plumbing.afterreply import after_reply

LOG = logs.get("test")


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name]


def test_a_line_logged_soon_follows_the_callback_that_logged_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    order: list[str] = []

    async def handler() -> None:
        logs.log_soon(LOG, "allocated", devices=2)
        order.append(f"reply sent with {len(_lines(caplog))} lines")
        await asyncio.sleep(0)
        order.append(f"next turn with {len(_lines(caplog))} lines")

    with caplog.at_level(logging.INFO):
        asyncio.run(handler())
    assert order == ["reply sent with 0 lines", "next turn with 1 lines"]
    (rec,) = [r for r in caplog.records if r.name == LOG.name]
    assert rec.__dict__["kv"] == {"devices": 2}


def test_off_a_loop_the_line_and_the_callback_come_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[int] = []
    with caplog.at_level(logging.INFO):
        logs.log_soon(LOG, "allocated")
        after_reply(lambda: ran.append(1))
    assert _lines(caplog) == ["allocated"] and ran == [1]


def test_a_disabled_level_queues_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def handler() -> int:
        logs.log_soon(LOG, "noise", level=logging.DEBUG)
        return len(asyncio.get_running_loop()._ready)  # type: ignore[attr-defined]

    with caplog.at_level(logging.INFO):
        assert asyncio.run(handler()) == 0
    assert _lines(caplog) == []


def test_values_with_spaces_and_quotes_are_quoted() -> None:
    record = logging.LogRecord("gpu-fraction.x", logging.INFO, __file__, 1, "a b", None, None)
    record.kv = {"reason": 'say "no"', "n": 3, "empty": ""}
    line = logs.KeyValueFormatter().format(record)
    assert line.endswith('msg="a b" reason="say \\"no\\"" n=3 empty=""')
    assert line.startswith("ts=") and " level=info logger=gpu-fraction.x " in line


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("pod\rlevel=error forged", '"pod\\rlevel=error forged"'),
        ("a\x1b[2Jb", '"a\\x1b[2Jb"'),
        ("a\u2028b", '"a\\u2028b"'),
        ("a\u2029b", '"a\\u2029b"'),
        ("\u202egnp.exe", '"\\u202egnp.exe"'),
        ("a\x00b\x7fc\x85d", '"a\\x00b\\x7fc\\x85d"'),
        ("tab\there", '"tab\\there"'),
        ("line\nnext", '"line\\nnext"'),
        ("back\\slash", '"back\\\\slash"'),
        ("plain-value", "plain-value"),
        ("GPU-\u00e9t\u00e9", "GPU-\u00e9t\u00e9"),  # printable unicode stays as it is
    ],
)
def test_values_from_others_cannot_break_or_forge_a_line(value: str, shown: str) -> None:
    record = logging.LogRecord("gpu-fraction.x", logging.INFO, __file__, 1, "m", None, None)
    record.kv = {"pod": value}
    line = logs.KeyValueFormatter().format(record)
    assert line.endswith(f" pod={shown}")
    assert line.isprintable()  # no control, separator or format character survives


def test_a_worker_threads_callbacks_wait_for_the_handler_that_holds_them() -> None:
    from deviceplugin.plumbing.afterreply import holding

    ran: list[str] = []

    def work() -> tuple[str, list[object]]:
        with holding() as later:
            after_reply(lambda: ran.append("status writer woken"))
            return "answer", list(later)

    async def handler() -> list[str]:
        answer, later = await asyncio.to_thread(work)
        seen = list(ran)  # nothing ran in the worker
        for callback in later:
            after_reply(callback)  # type: ignore[arg-type]
        seen.append(f"reply {answer}")
        await asyncio.sleep(0)
        return seen + ran

    assert asyncio.run(handler()) == ["reply answer", "status writer woken"]


def test_held_callbacks_run_at_once_when_the_work_fails() -> None:
    from deviceplugin.plumbing.afterreply import holding

    ran: list[int] = []
    with pytest.raises(RuntimeError), holding():
        after_reply(lambda: ran.append(1))
        raise RuntimeError("prepare bug")
    assert ran == [1]
    after_reply(lambda: ran.append(2))  # no longer held
    assert ran == [1, 2]

"""key=value log lines on stderr, one per event.

`log(logger, "event", key=value, ...)` is the only way the plugin logs: values are quoted
when they hold spaces or quotes, and expected errors carry no traceback. Values come from
others (pod names, annotations, claim fields, API errors), so every control character, line
or paragraph separator and bidi override is escaped: one event stays one line and shows what
it holds (no `\r` overwriting it, no terminal escape sequence, no forged `key=value`).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

from deviceplugin.plumbing.afterreply import after_reply

_CONFIGURED = False


# C0 and C1 controls and DEL; U+2028/2029 (line and paragraph separators, which some
# viewers break lines on); the bidi embeddings, overrides and isolates (U+202A-202E,
# U+2066-2069) that reorder what a terminal shows.
_UNSAFE = "\x00-\x1f\x7f-\x9f\u2028-\u202e\u2066-\u2069"
_NEEDS_QUOTES = re.compile(f'[ "=\\\\{_UNSAFE}]')
_ESCAPE = re.compile(f'["\\\\{_UNSAFE}]')
_NAMED = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _fmt(value: object) -> str:
    text = value if type(value) is str else str(value)
    if text == "" or _NEEDS_QUOTES.search(text) is not None:
        return '"' + _ESCAPE.sub(_escape, text) + '"'
    return text


class KeyValueFormatter(logging.Formatter):
    _second = -1
    _stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:  # strftime once a second, not once a line
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        parts = [
            f"ts={self._stamp}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_fmt(record.getMessage())}",
        ]
        fields: dict[str, Any] = getattr(record, "kv", {})
        parts.extend(f"{k}={_fmt(v)}" for k, v in fields.items())
        if record.exc_info:
            parts.append(f"exc={_fmt(self.formatException(record.exc_info))}")
        return " ".join(parts)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at the time: a thread that outlives a redirection
    (pytest's capture, a daemonizing caller) must not write into a closed stream."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup(level: int = logging.INFO) -> None:
    """Install the key=value handler on the root logger once per process."""
    global _CONFIGURED
    if _CONFIGURED:
        logging.getLogger().setLevel(level)
        return
    # What our lines never show, LogRecord need not look up for every line (the Logging
    # HOWTO's "Optimization" switches): the caller's frame, thread, process names.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = _StderrHandler()
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    _CONFIGURED = True


def log(logger: logging.Logger, msg: str, *, level: int = logging.INFO, **kv: object) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"kv": kv})


def log_soon(logger: logging.Logger, msg: str, *, level: int = logging.INFO, **kv: object) -> None:
    """`log`, but on an event loop after the callback running now: a gRPC handler's line is
    formatted and written once its reply is on the way (the line's time is then)."""
    if logger.isEnabledFor(level):
        after_reply(lambda: logger.log(level, msg, extra={"kv": kv}))


def get(name: str) -> logging.Logger:
    return logging.getLogger(f"gpu-fraction.{name}")

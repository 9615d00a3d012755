"""A status line while something slow runs, so a long start is never a silence: `kvplan up`
waiting for its services, `kvplan plan` loading and probing the model, `kvplan.pipeline()`
starting the embedded services. A first run in a fresh cache converts the model and builds the
CPU kernels, which takes about a minute (docs/benchmarks.md); later ones load the model.

    with Ticker("starting the executor") as t:
        t.say("loading the model")            # what it does now
        t.echo("executor SERVING ...")        # a line of output above the status line

On a terminal (stderr a TTY) one line, `kvplan: <what> (12s) <detail>`, redrawn twice a second
and cleared at the end. Elsewhere (a pipe, a log file, a notebook) nothing is redrawn: with
`lines`, one line each time `say` changes what it does; without, nothing. `follow_logs` shows
the latest INFO message of kvplan's loggers as the detail (the embedded services log there)."""
from __future__ import annotations

import logging
import shutil
import sys
import threading
import time


class Ticker:
    def __init__(self, what: str, stream=None, lines: bool = True, follow_logs: bool = False,
                 tty: bool | None = None, interval_s: float = 0.5):
        self.stream = stream or sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self.what, self.detail, self.lines, self.interval_s = what, "", lines, interval_s
        self.follow_logs = follow_logs
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._handler: logging.Handler | None = None
        self._level = logging.NOTSET

    def __enter__(self) -> "Ticker":
        self.t0 = time.monotonic()
        if self.tty:
            self._thread = threading.Thread(target=self._run, name="kvplan-ticker", daemon=True)
            self._thread.start()
        elif self.lines:
            self._line(f"kvplan: {self.what} ...")
        if self.follow_logs:
            self._handler = _Latest(self)
            log = logging.getLogger("kvplan")
            self._level = log.level
            log.addHandler(self._handler)
            if log.getEffectiveLevel() > logging.INFO:
                log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        if self._handler is not None:
            log = logging.getLogger("kvplan")
            log.removeHandler(self._handler)
            log.setLevel(self._level)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
            with self._lock:
                self._clear()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def say(self, what: str, detail: str = "") -> None:
        """What it does now (and a detail, e.g. the last line of a service's log)."""
        with self._lock:
            changed = what != self.what
            self.what, self.detail = what, detail
        if changed and not self.tty and self.lines:
            self._line(f"kvplan: {what} ...")

    def note(self, detail: str) -> None:
        with self._lock:
            self.detail = detail

    def echo(self, line: str, stream=None) -> None:
        """A line of output (stdout by default) above the status line."""
        with self._lock:
            if self.tty:
                self._clear()
            print(line, file=stream or sys.stdout, flush=True)
            if self.tty:
                self._draw()

    # -- drawing --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                self._draw()

    def _draw(self) -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        text = f"kvplan: {self.what} ({self.elapsed_s:.0f}s)" + (f" {self.detail}" if self.detail else "")
        self.stream.write("\r\033[K" + " ".join(text.split())[:width])
        self.stream.flush()

    def _clear(self) -> None:
        self.stream.write("\r\033[K")
        self.stream.flush()

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


class _Latest(logging.Handler):
    """The latest INFO (or louder) message of kvplan's loggers, as the ticker's detail."""

    def __init__(self, ticker: Ticker):
        super().__init__(logging.INFO)
        self.ticker = ticker

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.ticker.note(record.getMessage())
        except Exception:           # a message that cannot be formatted is no reason to fail a start
            pass


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

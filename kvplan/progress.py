"""Terminal output of a running job: streamed text on stdout, a prefill progress bar on stderr."""
from __future__ import annotations

import sys

from tqdm import tqdm

from kvplan.attempts import AttemptText
from kvplan.client import REPLAY, Stream

PROGRESS_MIN_TOKENS = 1024      # shorter prompts prefill in a blink: no bar


class EventPrinter:
    def __init__(self, stream_text: bool, progress: bool):
        self.stream_text, self.progress = stream_text, progress
        self.bar: tqdm | None = None
        self.attempt = 0
        self.text = AttemptText()          # a re-attach replays the job's events: print what is new only

    def __call__(self, st: Stream, ev) -> None:
        if ev is REPLAY:
            self.text.replay()
            return
        kind = ev.WhichOneof("kind")
        if ev.attempt > self.attempt:
            if self.attempt:
                self._close_bar()
                print("\n[kvplan: the executor was lost; another executor restarted the job]", file=sys.stderr)
            self.attempt = ev.attempt
        if kind == "progress" and self.progress and ev.progress.total >= PROGRESS_MIN_TOKENS:
            if self.bar is None:
                self.bar = tqdm(total=ev.progress.total, desc="prefill", unit="tok", file=sys.stderr, leave=False)
            self.bar.update(ev.progress.done - self.bar.n)
        elif kind in ("delta", "result"):
            self._close_bar()
            # the result has the text the deltas held back (what could have begun a stop sequence)
            new = self.text.feed(ev.attempt, ev.delta.text) if kind == "delta" else self.text.finish(ev.result.text)
            if self.stream_text and new:
                sys.stdout.write(new)
                sys.stdout.flush()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self._close_bar()
        if self.stream_text:
            sys.stdout.write("\n")
            sys.stdout.flush()

"""A job's text as a client shows it across attempts.

A job survives the executor that held it: another executor re-claims it and runs it again from
the start (`JobEvent.attempt` grows, and `WatchJob` replays every attempt's events). A client
that already showed the first attempt's text must not show it twice. `AttemptText` keeps what
was shown and, on a later attempt, holds the new text back until it passes that point, then
shows only the rest. A greedy job (or one with a seed) replays the same text, so the reader
sees one uninterrupted answer; one whose new text differs from what was shown raises
`Diverged` — the shown text cannot be taken back (the SDK and the HTTP gateway pick a seed for
sampled requests, so this needs a model or executor change between the attempts).
`AttemptItems` does the same for what comes one per token (log-probabilities): by count.
"""
from __future__ import annotations


class Diverged(RuntimeError):
    """A later attempt's text differs from the text already shown."""


class AttemptText:
    def __init__(self) -> None:
        self.attempt = 0
        self.shown = ""          # what the reader has seen (across attempts)
        self.text = ""           # the current attempt's text so far

    def replay(self) -> None:
        """The job's events start again from its first (a client re-attached with WatchJob):
        rebuild every attempt's text, showing only what passes the shown text."""
        self.attempt, self.text = 0, ""

    def feed(self, attempt: int, delta: str) -> str:
        """Add one delta of `attempt`; -> the part to show now (maybe empty)."""
        if attempt > self.attempt:
            self.attempt, self.text = attempt, ""
        elif attempt < self.attempt:
            return ""                                   # a stale event of an earlier attempt
        self.text += delta
        if len(self.text) <= len(self.shown):
            if not self.shown.startswith(self.text):
                raise Diverged(f"attempt {attempt} produced {self.text!r} where {self.shown[:len(self.text)]!r} "
                               "was already shown")
            return ""
        if not self.text.startswith(self.shown):
            raise Diverged(f"attempt {attempt} differs from the text already shown")
        new, self.shown = self.text[len(self.shown):], self.text
        return new

    def finish(self, text: str) -> str:
        """The job's final text (its result): -> what is left to show (a last character the
        deltas held back). The result's text is the answer; the deltas only ever show its prefix."""
        if not text.startswith(self.shown):
            return ""
        new, self.shown = text[len(self.shown):], text
        return new


class AttemptItems:
    """Per-token items (a delta's log-probabilities) as a client shows them across attempts: a
    later attempt's first items are the ones already shown (the same tokens, replayed), so
    only those past the shown count are new."""

    def __init__(self) -> None:
        self.attempt = 0
        self.seen = 0            # the current attempt's items so far
        self.shown = 0           # items the reader has seen (across attempts)

    def replay(self) -> None:
        self.attempt, self.seen = 0, 0

    def feed(self, attempt: int, items: list) -> list:
        """Add one delta's items of `attempt`; -> those to show now."""
        if attempt > self.attempt:
            self.attempt, self.seen = attempt, 0
        elif attempt < self.attempt:
            return []
        start, self.seen = self.seen, self.seen + len(items)
        new = items[max(0, self.shown - start):]
        self.shown = max(self.shown, self.seen)
        return new

    def finish(self, items: list) -> list:
        """The job's every item (its result): -> those not shown yet."""
        new, self.shown = items[self.shown:], max(self.shown, len(items))
        return new

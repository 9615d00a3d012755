"""`kvplan demo` (what `make run` does): one question about a short document, answered twice —
under `full` (the whole KV cache) and under `auto` at a reserve ratio of 0.2 — with the KV bytes
each answer's cache really held, side by side. The document is this project's own text."""
from __future__ import annotations

import sys

from kvcore.blocks import BLOCK_ROWS

DEMO_CONTEXT = """\
The Meridian Line is a night train that leaves Lisbon at 21:40 and reaches Madrid at 07:15. It \
runs every day except on the 25th of December, when the crew and the carriages rest in the \
depot at Entroncamento.

The train has eleven sleeping cars, one dining car and one observation car at the rear. Each \
sleeping car holds ten compartments of two berths, and every compartment has a washbasin, a \
reading lamp and a small window that opens a hand's width. The observation car was rebuilt in \
2019 with wide windows and twelve armchairs; it closes at midnight and opens again at six.

The dining car serves grilled sardines, a vegetable soup, rice with clams and an orange cake \
that the cook, Tomas Vieira, bakes before the train leaves Lisbon. Breakfast is bread, butter, \
cheese, coffee and tea, served from half past six until the train reaches Madrid.

The line was opened in 1987, when two older services, one from Porto and one from Lisbon, were \
joined into a single train. For its first ten years it ran only in summer. The winter service \
began in 1998, after the sleeping cars were fitted with new heating, and since then the train \
has run all year.

Every sleeping car has an attendant who makes the beds, wakes passengers who ask to be woken, \
and serves coffee in the morning. The attendants work in pairs on alternate nights, so that \
each car always has someone awake. They carry a key to every compartment and a small box of \
spare towels, soap and earplugs.

The carriages were built in Spain and are painted dark blue with a thin yellow line below the \
windows. They were refurbished twice, in 2004 and in 2018. The second refurbishment added power \
sockets to every compartment, replaced the carpets and installed quieter doors between the \
cars.

The conductor of the Meridian Line is Ines Rocha. She has worked on the line for nineteen \
years, first as a steward in the dining car and, since 2016, as its conductor. She checks every \
ticket herself before the train crosses the border at Marvao, and she keeps a notebook in which \
each passenger who asks may write a line about the journey.

Two engineers share the locomotive: Rui Santos drives from Lisbon to the border and Carmen Diaz \
from the border to Madrid. They change at Valencia de Alcantara at half past one, where the \
train waits for eleven minutes. Passengers may not leave the train there.

Luggage goes in the racks above the berths or in a locked room at the front of the second \
sleeping car. Bicycles travel in the luggage van if they are booked two days ahead. Dogs under \
ten kilograms may travel in a compartment booked for their owner alone.

Tickets can be bought at the stations of Lisbon Oriente and Madrid Chamartin, or from the \
line's office in Coimbra, which is open from nine to five on weekdays. A berth costs less in \
January and February, when the train is often half empty, and most in August.

On the way to the border the train stops at Santarem, Entroncamento and Abrantes. After the \
border it stops at Caceres, Navalmoral de la Mata and Talavera de la Reina before it reaches \
Madrid. Passengers may join the train at any stop before midnight, but not after, because the \
attendants lock the doors of the sleeping cars at midnight.

In summer the train is often full, and the line adds a twelfth sleeping car on Fridays and \
Saturdays. In winter it sometimes runs with only nine. The dining car is the same all year, and \
so is the observation car, which many passengers consider the best part of the journey."""

DEMO_QUESTION = "What is the name of the conductor of the Meridian Line mentioned in the provided text?"
DEMO_RATIO = 0.2
DEMO_NEW_TOKENS = 24


def run(addr: str, client_timeout_s: float, out=print) -> int:
    """Ask the question under `full`, then under `auto` at DEMO_RATIO; print both answers and
    both caches' bytes. -> exit code (1 when a job failed)."""
    from kvplan.client import ExecutorClient, request
    rows = []
    with ExecutorClient(addr, client_timeout_s) as client:
        for strategy, ratio in (("full", None), ("auto", DEMO_RATIO)):
            st = client.run(request(DEMO_CONTEXT, question=DEMO_QUESTION, strategy=strategy, reserve_ratio=ratio,
                                    max_new_tokens=DEMO_NEW_TOKENS))
            if st.result is None:
                print(f"kvplan: demo job under {strategy} ended without a result: "
                      f"{st.status.error if st.status else ''}", file=sys.stderr)
                return 1
            rows.append((strategy, ratio, st.result))
    out(f"Q: {DEMO_QUESTION}  ({rows[0][2].prompt_tokens} prompt tokens)\n")
    for strategy, ratio, r in rows:
        asked = f" at {ratio:g}" if ratio else ""
        out(f"[{strategy}{asked}] {r.text.strip()}")
    out("")
    out(f"{'strategy':<10} {'KV bytes held':>14} {'full KV bytes':>14} {'ratio':>6}  degraded  at risk")
    for strategy, ratio, r in rows:
        out(f"{strategy:<10} {r.kv_bytes:>14,} {r.full_kv_bytes:>14,} {r.reserve_ratio:>6.3f}  "
            f"{'yes' if r.degraded else 'no':<8}  {'YES' if r.kv_at_risk else 'no'} ({r.kv_risk:.0%} not from the prompt)")
    full, auto = rows[0][2], rows[1][2]
    if auto.kv_bytes:
        out(f"\nauto held {auto.kv_bytes / full.kv_bytes:.1%} of full's KV bytes "
            f"({full.kv_bytes - auto.kv_bytes:,} bytes fewer).")
    if auto.kv_at_risk:
        out(f"auto's answer is AT RISK: {auto.kv_risk:.0%} of it is copied from nowhere in the prompt, as the compressed "
            "answers that went wrong on the quality bench were (kv_risk, docs/benchmarks.md); check it against a larger ratio.")
    if full.reserve_ratio > 1.0:
        out(f"full holds a little more than the full cache: the pool stores whole blocks of {BLOCK_ROWS} rows "
            "per KV head and layer, the last one partly empty.")
    return 0

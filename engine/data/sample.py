"""The tokenizer's training text: a bounded, balanced, deterministic sample of every source.

Only the sample is read. Each source gets a share of `train_bytes` (water-filling: a source
smaller than its even share gives the rest to the others) and its share is chosen evenly over the
source: over its documents for a built-in arm, over its files and the pieces of its large files
for a path source (engine.data.plan; pieces of about a 32nd of a source's share, so that even a
single large file is sampled all along), so a 5 GB file costs no more than a small one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engine.config import SourceConfig
from engine.data.builtin import even_selection
from engine.data.plan import plan_source
from engine.data.reader import read_segments

SAMPLE_PART_BYTES = (16 << 10, 1 << 20)  # the bounds of a sample piece
# The text goes to the trainer in segments cut at safe places (engine.data.cuts): the same words
# as whole documents, so the same tokenizer, without a long document held whole.
SAMPLE_SEGMENT_CHARS = 1 << 16


def training_budgets(totals: list[int], train_bytes: int) -> list[int]:
    """Split train_bytes over sources as evenly as their sizes allow (water-filling): a source
    smaller than its even share gives the rest to the others."""
    budgets = [0] * len(totals)
    remaining = train_bytes
    order = sorted(range(len(totals)), key=lambda i: totals[i])
    for rank, i in enumerate(order):
        budgets[i] = min(totals[i], remaining // (len(totals) - rank))
        remaining -= budgets[i]
    return budgets


def training_texts(sources: Sequence[SourceConfig], train_bytes: int) -> Iterator[str]:
    """At most train_bytes of text from `sources`, spread over each (a long text is cut on a
    character boundary to fit)."""
    lo, hi = SAMPLE_PART_BYTES
    part_bytes = min(hi, max(lo, train_bytes // (32 * max(len(sources), 1))))
    plans = [plan_source(s, part_bytes, group=False) for s in sources]
    budgets = training_budgets([p.total_bytes for p in plans], train_bytes)
    for plan, budget in zip(plans, budgets, strict=True):
        keep = set(even_selection([p.nbytes for p in plan.parts], budget))
        taken = 0
        for i, part in enumerate(plan.parts):
            if taken >= budget:
                break
            if i not in keep:
                continue
            skip = False  # the rest of a document cut to fit is not taken
            for text, ends in read_segments(part, SAMPLE_SEGMENT_CHARS):
                room = budget - taken
                if room <= 0:
                    break
                if skip or not text:
                    skip = skip and not ends
                    continue
                data = text.encode("utf-8")
                if len(data) > room:
                    text = data[:room].decode("utf-8", "ignore")
                    data = text.encode("utf-8")
                    skip = not ends
                taken += len(data)
                yield text

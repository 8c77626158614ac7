"""``kvtier bench soak``: a real engine serves resumed sessions while the
storage under kvtier is damaged at random.

By role:

- ``runner``: the model, the request stream, the reference and soak engine
  processes one after the other (``run``);
- ``engine``: the soak engine process (``python -m kvtier.bench.soak.engine``):
  vLLM with kvtier, serving while an ``Injector`` damages its storage;
- ``faults``: the ``Injector`` and the fault kinds, one injector function per
  row of ``FAULTS``;
- ``report``: each answer judged against the reference (``judge``), the
  report's text (``format_report``).

The command itself (its arguments) is ``kvtier.bench.cli``.

The report: requests served, faults injected by kind, wrong-token requests
(against the reference; must be 0), failed requests (must be 0), changes
outside the store (the copies the links point to; must be 0), and what kvtier
counted (integrity failures, blocks recomputed after a failed load, dropped
saves, hit tokens). Exit status 1 if any must-be-0 figure is not.
"""

from kvtier.bench.soak.faults import FAULTS
from kvtier.bench.soak.report import REFERENCES, format_report
from kvtier.bench.soak.runner import run

__all__ = ["FAULTS", "REFERENCES", "format_report", "run"]

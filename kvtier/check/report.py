"""The rows of ``kvtier check`` and how they are shown.

A row is one check: its name, OK, WARN or FAIL, what was found, and for
WARN and FAIL the fix. Every text that leaves the report (table or JSON)
has each secret the run handled (passwords, secret keys: ``secret``)
replaced by ``***`` first, whatever library message it came in.

Exit status: 2 when the configuration could not be read (the rows say
which key and how to fix it; nothing else could be checked), 1 when a check
FAILed (or WARNed, with ``strict``), else 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

OK, WARN, FAIL = "OK", "WARN", "FAIL"
REDACTED = "***"


@dataclass(frozen=True)
class Row:
    check: str  # what was checked, e.g. "tiers[disk] folder"
    status: str  # OK, WARN or FAIL
    detail: str  # what was found
    fix: str = ""  # what to do about it (WARN and FAIL)


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    config_unreadable: bool = False  # the configuration itself did not parse: exit 2
    _secrets: set[str] = field(default_factory=set)

    def ok(self, check: str, detail: str) -> None:
        self.rows.append(Row(check, OK, detail))

    def warn(self, check: str, detail: str, fix: str) -> None:
        self.rows.append(Row(check, WARN, detail, fix))

    def fail(self, check: str, detail: str, fix: str) -> None:
        self.rows.append(Row(check, FAIL, detail, fix))

    def secret(self, value: object) -> None:
        """Never show ``value`` (a password, a key) in this report's output."""
        if isinstance(value, str) and value:
            self._secrets.add(value)

    def _redact(self, text: str) -> str:
        for s in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(s, REDACTED)
        return text

    def shown(self) -> list[Row]:
        """The rows as they may be shown: secrets replaced."""
        return [Row(self._redact(r.check), r.status, self._redact(r.detail), self._redact(r.fix)) for r in self.rows]

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.rows)

    def exit_status(self, strict: bool = False) -> int:
        if self.config_unreadable:
            return 2
        if self.count(FAIL) or (strict and self.count(WARN)):
            return 1
        return 0

    def summary(self, strict: bool = False) -> str:
        counts = ", ".join(f"{self.count(s)} {s}" for s in (OK, WARN, FAIL))
        status = self.exit_status(strict)
        why = {0: "ready" + (" (read the warnings)" if self.count(WARN) else ""),
               1: "not ready: fix what FAILed" + (" or WARNed (--strict)" if strict and self.count(WARN) else ""),
               2: "the configuration cannot be read: fix it and run again"}[status]
        return f"kvtier check: {counts}; {why} (exit status {status})"

    def table(self, strict: bool = False) -> str:
        """One row per check, columns aligned; a WARN or FAIL row's fix on
        the line below its detail."""
        rows = self.shown()
        w_status = max([len("STATUS")] + [len(r.status) for r in rows])
        w_check = max([len("CHECK")] + [len(r.check) for r in rows])
        lines = [f"{'STATUS':<{w_status}}  {'CHECK':<{w_check}}  DETAIL"]
        indent = " " * (w_status + w_check + 4)
        for r in rows:
            lines.append(f"{r.status:<{w_status}}  {r.check:<{w_check}}  {r.detail}")
            if r.fix and r.status != OK:
                lines.append(f"{indent}fix: {r.fix}")
        lines.append("")
        lines.append(self.summary(strict))
        return "\n".join(lines)

    def as_json(self, strict: bool = False) -> dict:
        return {"rows": [asdict(r) for r in self.shown()],
                "counts": {s: self.count(s) for s in (OK, WARN, FAIL)},
                "exit_status": self.exit_status(strict)}

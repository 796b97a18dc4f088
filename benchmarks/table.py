"""What a group prints: one row per case (its figures, or FAILED and why), then ratios kit / peer.

A row's figures are printed only when its output was read back and checked; a row whose run
raised or whose check failed shows FAILED in every figure column and the reason in the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Check:
    """What a case's output held when it was read back: ``keys`` is None where the sink keeps
    nothing to read (Spark's noop sink: the count is the query's own input count)."""

    expected: int
    count: int
    keys: int | None

    @property
    def ok(self) -> bool:
        return self.count == self.expected and self.keys in (None, self.expected)

    def __str__(self) -> str:
        got = f"{self.count:,} records" + ("" if self.keys is None else f", {self.keys:,} distinct keys")
        return got if self.ok else f"FAILED: {got}, expected {self.expected:,} of each"


@dataclass(frozen=True)
class Row:
    case: str
    figures: dict[str, float]
    read_back: str

    @property
    def ok(self) -> bool:
        return bool(self.figures)

    @classmethod
    def failed(cls, case: str, why: str) -> Row:
        return cls(case, {}, why if why.startswith("FAILED") else f"FAILED: {why}")


@dataclass(frozen=True)
class Ratio:
    """``numerator`` / ``denominator``, two case names of the same table."""

    numerator: str
    denominator: str


@dataclass
class Table:
    title: str
    columns: tuple[str, ...]
    ratio_columns: tuple[str, ...]
    ratio_meaning: str
    rows: list[Row] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, case: str) -> Row | None:
        return next((row for row in self.rows if row.case == case), None)

    def ratio(self, ratio: Ratio, column: str) -> str:
        top, bottom = self.row(ratio.numerator), self.row(ratio.denominator)
        if (top is None or bottom is None or not top.ok or not bottom.ok or column not in top.figures
                or not bottom.figures.get(column)):
            return "n/a"
        return f"{top.figures[column] / bottom.figures[column]:.2f}"

    def render(self) -> str:
        width = max([len("case")] + [len(row.case) for row in self.rows])
        head = f"| {'case':<{width}} | " + " | ".join(f"{c:>10}" for c in self.columns) + " | read back |"
        rule = f"|{'-' * (width + 2)}|" + "|".join("-" * 11 + ":" for _ in self.columns) + "|-----------|"
        lines = [f"\n## {self.title}", *self.notes, "", head, rule]
        for row in self.rows:
            missing = "FAILED" if row.read_back.startswith("FAILED") else "-"
            cells = [f"{row.figures[c]:>10,.1f}" if c in row.figures and row.figures[c] < 100 else
                     f"{row.figures[c]:>10,.0f}" if c in row.figures else f"{missing:>10}" for c in self.columns]
            lines.append(f"| {row.case:<{width}} | " + " | ".join(cells) + f" | {row.read_back} |")
        if self.ratios:
            label = max(len(f"{r.numerator} / {r.denominator}") for r in self.ratios)
            lines += ["", f"Ratios, kit / peer ({self.ratio_meaning}):", "",
                      f"| {'pair':<{label}} | " + " | ".join(f"{c:>10}" for c in self.ratio_columns) + " |",
                      f"|{'-' * (label + 2)}|" + "|".join("-" * 11 + ":" for _ in self.ratio_columns) + "|"]
            for ratio in self.ratios:
                cells = [f"{self.ratio(ratio, c):>10}" for c in self.ratio_columns]
                lines.append(f"| {ratio.numerator + ' / ' + ratio.denominator:<{label}} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

"""A campaign's results: one row per fault, the pass rule, and the Markdown table and JSON file
``oncekit verify`` writes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from oncekit.verify.checker import ALLOWED_VERDICTS


@dataclass(frozen=True)
class FaultResult:
    """One fault's row in the campaign table. ``batch``: the batch it hit (the batch in flight
    for kills and service faults); ``recovery_s``: from the end of the fault (the crash, the
    kill, the service back) until all input produced so far was committed in the output;
    ``next_commit_s``: from the end of the fault until Spark committed a batch (nan when none was
    needed: the fault hit after the last one); ``stalled``: not caught up within the campaign's
    catch-up window, a failure whatever the output holds."""

    fault: str
    fired: bool
    batch: int | None
    query_restarts: int
    driver_restarts: int
    recovery_s: float
    verdict: str
    detail: str
    stalled: bool = False  # not caught up in time; the driver was killed and restarted
    next_commit_s: float = float("nan")


@dataclass(frozen=True)
class CampaignReport:
    pipeline: str
    seed: int
    guarantee: str
    results: list[FaultResult]
    final: str  # the verdict over all input after the driver stopped
    left_behind: list[str]
    log: str

    @property
    def passed(self) -> bool:
        allowed = ALLOWED_VERDICTS[self.guarantee]
        return (not self.left_behind and all(r.verdict in allowed and not r.stalled for r in self.results)
                and self.final in allowed)

    @property
    def longest_recovery_s(self) -> float:
        return max((r.recovery_s for r in self.results if r.recovery_s == r.recovery_s), default=0.0)


def table(report: CampaignReport) -> str:
    """The campaign as a Markdown table, with the seed and schedule that reproduce it."""
    lines = [f"oncekit verify: pipeline {report.pipeline}, guarantee {report.guarantee}, seed {report.seed}, "
             f"{len(report.results)} faults",
             f"| {'#':>2} | {'fault':<46} | {'fired':<5} | {'batch':>5} | {'query restarts':>14} | "
             f"{'driver restarts':>15} | {'next commit s':>13} | {'recovery s':>10} | {'verdict':<15} |",
             f"|{'-' * 4}|{'-' * 48}|{'-' * 7}|{'-' * 7}|{'-' * 16}|{'-' * 17}|{'-' * 15}|{'-' * 12}|{'-' * 17}|"]
    for i, r in enumerate(report.results):
        batch = "" if r.batch is None else str(r.batch)
        verdict = f"{r.verdict}, STALL" if r.stalled else r.verdict
        lines.append(f"| {i:>2} | {r.fault:<46} | {'yes' if r.fired else 'no':<5} | {batch:>5} | "
                     f"{r.query_restarts:>14} | {r.driver_restarts:>15} | {r.next_commit_s:>13.1f} | "
                     f"{r.recovery_s:>10.1f} | {verdict:<15} |")
    stalled = [str(i) for i, r in enumerate(report.results) if r.stalled]
    if stalled:
        lines.append(f"STALLED (not caught up within the catch-up window; the driver was killed and restarted, its "
                     f"stacks are in the report's log): fault {', '.join(stalled)}")
    lines.append(f"final: {report.final}; left behind: {', '.join(report.left_behind) or 'nothing'}; "
                 f"longest recovery {report.longest_recovery_s:.1f} s")
    return "\n".join(lines)


def write_json(path: str, report: CampaignReport) -> None:
    data = {**asdict(report), "passed": report.passed, "longest_recovery_s": report.longest_recovery_s}
    data.pop("log")
    Path(path).write_text(json.dumps(data, indent=2))

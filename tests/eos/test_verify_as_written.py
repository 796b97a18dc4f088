"""``oncekit verify`` runs a user's job as written (tests/eos/user_job.py: its own broker, topic,
table and checkpoint, ``start(spark)``), as the verifying page shows it: from the job's folder,
with the user's records in a file. Every fault's output equals the job's own clean run, and the
clean run committed the rows a reader of the input expects."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from tests.docs.console import console_commands
from tests.eos.test_verify_campaign import REPORTS, SEED

pytestmark = [pytest.mark.services, pytest.mark.spark]


def orders(count: int, seed: int) -> tuple[list[str], int]:
    """``count`` order events as JSON lines (every seventh malformed), and how many are paid: the
    rows the job must commit."""
    rng = random.Random(seed)
    lines: list[str] = []
    paid = 0
    for order_id in range(count):
        if order_id % 7 == 3:
            lines.append('{"order_id": oops')
            continue
        status = rng.choice(["paid", "paid", "cancelled"])
        amount = Decimal(rng.randrange(100, 100_000)) / 100
        lines.append(json.dumps({"order_id": order_id, "customer": f"c{order_id % 13}", "amount": str(amount),
                                 "status": status}))
        paid += status == "paid"
    return lines, paid


@pytest.mark.long(150)
def test_oncekit_verify_runs_a_job_as_written_against_its_own_clean_run(tmp_path: Path) -> None:
    lines, paid = orders(600, SEED)
    (tmp_path / "orders.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(Path(__file__).with_name("user_job.py"), tmp_path / "user_job.py")
    env = {k: v for k, v in os.environ.items() if k != "ONCEKIT_CRASH_DIR"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    backend = os.environ.get("ONCEKIT_TEST_BACKEND", "auto")
    (command,) = console_commands("verify-job", {"--faults 10": f"--faults 1 --seed {SEED} --backend {backend} "
                                                                "--json verify.json"})
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "oncekit-verify-job.out").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    # Not vacuous: the clean run the faulted one is held to committed every paid order.
    assert re.search(rf"clean run: chunk 1/1, {paid} records committed", out.stdout), (paid, out.stdout)
    rows = [line for line in out.stdout.splitlines() if re.match(r"\|\s+\d+ \|", line)]
    assert len(rows) == 1 and "exactly-once" in rows[0], out.stdout
    assert "left behind: nothing" in out.stdout and (tmp_path / "verify.json").exists(), out.stdout

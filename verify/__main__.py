"""The driver process of a campaign: ``python -m oncekit.verify '<spec json>'`` (started by
:func:`oncekit.verify.driver.start_driver`)."""

from __future__ import annotations

import sys

from oncekit.verify.driver import main

sys.exit(main(sys.argv[1]))

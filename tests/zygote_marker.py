"""Imported by the zygote in tests/launch_driver.py's ``zygote-imports`` stage: says that the
zygote is importing (FIFO ``$MARK_READY``), then waits until the test's signal was sent
(``$MARK_GO`` opened). A zygote whose launcher is gone dies here (its death signal)."""

import os

with open(os.environ["MARK_READY"], "w") as f:
    f.write("importing\n")
with open(os.environ["MARK_GO"]) as f:
    f.read()

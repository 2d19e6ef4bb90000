"""Concurrency: a reader restoring every step it lists while another process commits and retention
deletes; a second manager (in this process) refused while a live process holds the directory; saves
from a thread while the main thread trains with donated buffers.

Extends test_manager.py (a second manager in the same process, a sleeping lock holder, a thread
saving plain states).
"""

from __future__ import annotations

import pytest
from reliability_trials import Tally, reader_trial, thread_saves_trial
from reliability_worker import Zygote


@pytest.mark.timeout(400)
def test_reader_during_commits_and_retention_sees_only_whole_steps(tmp_path):
    tally = Tally("reader")
    with Zygote() as z:
        reader_trial(z, str(tmp_path / "ckpts"), 6.0, tally, restores=10)  # 6 s, then 10 restores
    assert tally.counts["exact"] == tally.trials, "\n".join(tally.failures)
    assert tally.notes["second manager refused"] == 1
    assert tally.notes["restored while committing"] >= 10, tally.notes


@pytest.mark.timeout(120)
def test_saves_from_a_thread_while_the_main_thread_trains(tmp_path):
    outcome = thread_saves_trial(str(tmp_path / "ckpts"))
    assert outcome.ok, f"{outcome.kind}: {outcome.detail}"

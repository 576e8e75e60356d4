"""Library code logs through the ``chipset`` logger with the rank in each line; the level is the user's."""

from __future__ import annotations

import logging

from chipset.logs import configure


def test_rank_prefix_and_level_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("CHIPSET_LOG_LEVEL", "warning")
    configure(rank=3)
    log = logging.getLogger("chipset.train.something")
    log.info("hidden")
    log.warning("shown %d", 7)
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert "[rank 3] WARNING chipset.train.something: shown 7" in err
    configure(rank=0)  # reconfiguring replaces the handler instead of doubling every line
    log.warning("once")
    assert capsys.readouterr().err.count("once") == 1

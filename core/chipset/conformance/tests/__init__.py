"""Conformance test modules, one per group (``test_<group>.py``)."""

"""Building blocks that model families share (the mixture-of-experts layer)."""

"""The soak: an open loop of mixed requests at a share of saturation, watched and judged per window."""

"""Plan "auto": each round's layout, priced from the one cost model."""

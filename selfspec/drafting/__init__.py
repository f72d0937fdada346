"""Pure drafting: trees, scoring and rho, the context index, the walk, sampling; no model."""

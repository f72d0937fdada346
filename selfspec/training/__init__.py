"""Training recipes: the shipped models and the learned rho's collection."""

"""The model's forward over cache rows, its masks and its K/V."""

"""Measuring a device: the cost model, the weight format choice, what a measurement was taken for."""

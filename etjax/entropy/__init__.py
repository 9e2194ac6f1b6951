"""The entropy signal: estimators, the entropic clock, the cost model and the controller."""

"""Calibration of the entropy signal: how well a model's probabilities match what happens
(`metrics.py`), a temperature fitted to text with optax (`fit.py`), the small JSON file that
holds it (`file.py`) with the identity of the model it was fitted on (`identity.py`), and the
calibrated entropy the engine's levels read (`signal.py`)."""

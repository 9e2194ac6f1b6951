"""Calibration of the entropy signal, as the engine reads it: the small JSON file that holds a
fitted temperature (`file.py`) with the identity of the model it was fitted on
(`identity.py`), the calibrated entropy the engine's levels read (`signal.py`) and the pruning
ramp's shift under it (`ramp.py`). Fitting one is etjax/calibrate/ (`etjax calibrate`)."""

"""`etjax calibrate`: fitting the entropy signal's calibration to text, by running the model.

How well a model's probabilities match what happens (`metrics.py`), a temperature fitted to
text with optax (`fit.py`), and the command (`command.py`). What a calibration is, the file
that holds it and how the engine applies it live below, in etjax/calibration/: the engine reads
a calibration, this package makes one (it sits above the runtime whose steps it runs)."""

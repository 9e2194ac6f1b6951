"""Running a model: the jitted step programs, the per-row decode state and the engine's sizes.
The host loop that drives them is etjax/engine, above this package."""
